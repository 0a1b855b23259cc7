import pytest
import torch


@pytest.fixture(autouse=True)
def single_thread():
    """Tiny models run fastest on one thread; two intra-op threads on a shared 2-core machine stall badly."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
