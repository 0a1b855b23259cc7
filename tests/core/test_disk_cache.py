"""The disk cache's writes (core/disk_cache.py): whole files only, whoever writes at once."""
from __future__ import annotations

import json
import threading

from arborspec.core.disk_cache import write_json


def test_threads_writing_one_record_never_leave_it_torn(tmp_path):
    """Two threads of one process shared one temporary name (the PID's): writes failed with FileNotFoundError and
    readers got half a file (606 torn reads in 6000)."""
    path, errors, torn = tmp_path / "record.json", [], []

    def write(value: int) -> None:
        for _ in range(300):
            try:
                write_json(path, {"value": value, "pad": "x" * 20000})
            except Exception as err:  # noqa: BLE001 - any failure is the finding
                errors.append(err)

    writers = [threading.Thread(target=write, args=(v,)) for v in (1, 2)]
    for w in writers:
        w.start()
    while any(w.is_alive() for w in writers):
        try:
            json.loads(path.read_text())
        except FileNotFoundError:
            pass  # not written yet
        except json.JSONDecodeError as err:
            torn.append(err)
    assert not errors and not torn
    assert not list(tmp_path.glob("*.tmp"))


def test_a_models_fingerprint_sees_its_middle_layers():
    """It sampled the first 64 values of the first and last two weights: a checkpoint saved again over the same
    directory with other middle layers kept its old int8 draft."""
    import torch

    from arborspec.core.disk_cache import model_fingerprint
    from tests.conftest import tiny_model
    model = tiny_model("llama", seed=0)
    before = model_fingerprint(model)
    with torch.no_grad():
        model.model.layers[1].mlp.up_proj.weight[5:].add_(0.01)  # past its first 64 values
    assert model_fingerprint(model) != before
