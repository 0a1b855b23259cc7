"""The GGUF header reader (backends/gguf_file.py): what it reports equals what gguf's own reader reports, without
gguf's reader for a readable file, and a file it cannot read gets gguf's one-line error."""
from __future__ import annotations

import gguf
import numpy as np
import pytest

from arborspec.backends import gguf_file
from arborspec.backends.gguf_file import read_gguf, read_gguf_info

from .tiny_gguf import write_tiny_gguf


@pytest.mark.parametrize("options", [{}, {"dtype": "mixed", "arch": "llama"}, {"dtype": "q4_k", "hidden": 256,
                                                                              "ffn": 512}, {"pooling": 1}])
def test_the_header_reads_as_gguf_reads_it_without_gguf_reader(tmp_path, monkeypatch, options):
    path = write_tiny_gguf(tmp_path / "m.gguf", **options)
    slow = gguf_file._info_by_gguf(path)
    reader = gguf.GGUFReader(path)
    monkeypatch.setattr(gguf, "GGUFReader", lambda *a, **k: pytest.fail("gguf's reader was used"))
    assert read_gguf_info(path) == slow
    assert slow.embedding_model == ("pooling" in options)
    table = read_gguf(path).tensors
    assert [(t.name, t.offset, t.nbytes) for t in table] == [
        (t.name, t.data_offset, t.n_bytes) for t in reader.tensors]


def test_a_file_it_cannot_read_gets_ggufs_one_line_error(tmp_path):
    good = write_tiny_gguf(tmp_path / "good.gguf").read_bytes()
    cases = {"data-cut": (good[:-1000], "is a truncated"), "header-cut": (good[:200], "is a truncated or corrupt"),
             "text": (b"not a model\n" * 10, "is not a GGUF file"), "empty": (b"", "is a truncated or corrupt")}
    for name, (data, message) in cases.items():
        (tmp_path / f"{name}.gguf").write_bytes(data)
        with pytest.raises(ValueError, match=message):
            read_gguf_info(tmp_path / f"{name}.gguf")


@pytest.mark.parametrize("key,value,kind", [
    ("block_count", 0, gguf.GGUFValueType.UINT32), ("attention.head_count", 0, gguf.GGUFValueType.UINT32),
    ("attention.head_count_kv", 0, gguf.GGUFValueType.UINT32), ("context_length", -5, gguf.GGUFValueType.INT32),
    ("embedding_length", 0, gguf.GGUFValueType.UINT64), ("rope.freq_base", float("nan"), gguf.GGUFValueType.FLOAT32),
    ("rope.freq_base", 0.0, gguf.GGUFValueType.FLOAT32),
])
def test_a_size_out_of_range_is_a_corrupt_file_for_both_readers(tmp_path, key, value, kind):
    """Refused when the header is read, before either backend runs it: llama.cpp aborted the process on 0 layers."""
    writer = gguf.GGUFWriter(str(tmp_path / "bad.gguf"), "qwen2")
    writer.add_key_value(f"qwen2.{key}", value, kind)
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match=f"is a corrupt GGUF file: qwen2.{key} is"):
        read_gguf_info(tmp_path / "bad.gguf")
    with pytest.raises(ValueError, match=f"is a corrupt GGUF file: qwen2.{key} is"):
        gguf_file._info_by_gguf(tmp_path / "bad.gguf")
