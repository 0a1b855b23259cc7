"""benchmarks/kernel_shapes.py on a tiny K-quant GGUF: it finds and groups the matrices the kernels cover (the embedding
table left out), times them, and its whole-model table adds the groups up and divides by the right rooflines."""
import pytest

from tests.backends.tiny_gguf import write_tiny_gguf
from tests.conftest import load_benchmark


@pytest.fixture(scope="module")
def script():
    return load_benchmark("kernel_shapes")


def test_groups_cover_every_layer_matrix_and_the_head(script, tmp_path):
    path = write_tiny_gguf(tmp_path / "m.gguf", dtype="mixed", hidden=256, ffn=512, layers=2)
    groups = script.load_groups(path)
    kinds = {name.split()[0] for name in groups}
    assert kinds == {"attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down", "output"}
    assert all(len(mats) == 2 for name, mats in groups.items() if not name.startswith("output"))
    assert script.time_group(groups[next(iter(groups))], m=3, repeats=1) > 0


def test_whole_model_rows_sum_the_groups(script):
    rows = [{"group": g, "matrices": 1, "bytes": 10, "m": m, "seconds": s * m, "memory_roofline": 1.0,
             "compute_roofline": 0.25 * m} for g, s in (("a", 1.0), ("b", 3.0)) for m in (1, 4)]
    result = {"rows": rows, "cpu": "cpu", "isa": "avx2", "threads": 2, "bandwidth_GBps": 30.0,
              "multiply_add_G_per_s": 400.0, "model": "m.gguf"}
    totals = script.totals(result)
    assert totals[4] == {"seconds": 16.0, "memory_roofline": 2.0, "compute_roofline": 2.0}
    table = script.markdown(result, "cmd")
    assert "| 4 | 16000.0 | 4.00 | 2000.0 | 2000.0 | 8.00 |" in table
