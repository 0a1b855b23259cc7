"""Tiny tensors run ~100x faster on one intra-op thread than on two on a busy machine (softmax of a (4, 8) tensor:
~1 us vs ~500 us), so every test here runs single-threaded."""
import pytest

from tests.verify.harness import single_thread


@pytest.fixture(autouse=True)
def _one_thread():
    with single_thread():
        yield
