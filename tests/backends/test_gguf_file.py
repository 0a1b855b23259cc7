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


def _write(path, tensors: dict, **keys):
    writer = gguf.GGUFWriter(str(path), "qwen2")
    for key, value in keys.items():
        writer.add_uint32(f"qwen2.{key}", value)
    for name, (array, raw_shape, qtype) in tensors.items():
        writer.add_tensor(name, array, raw_shape=raw_shape, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_a_tensor_table_no_model_can_have_is_a_corrupt_file_for_both_readers(tmp_path):
    """Refused when the header is read: rows that are not whole blocks (the size read rounded down in silence and
    native failed later naming neither file nor tensor), and more layers declared than the file holds (native built
    every declared one first: a block_count of 100000 ran out of memory)."""
    plain = {"token_embd.weight": (np.zeros((4, 8), np.float32), None, None),
             "blk.0.attn_norm.weight": (np.ones(8, np.float32), None, None),
             "blk.1.attn_norm.weight": (np.ones(8, np.float32), None, None)}
    # a Q4_K matrix of 2 rows of 256 values (144 bytes each), its rows then said to hold 288: not whole blocks
    q4k = {"blk.1.ffn_down.weight": (np.zeros((2, 144), np.uint8), (2, 144), gguf.GGMLQuantizationType.Q4_K)}
    rows = _write(tmp_path / "rows.gguf", {**plain, **q4k}, block_count=2)
    data = bytearray(rows.read_bytes())
    name = b"blk.1.ffn_down.weight"
    at = data.index(len(name).to_bytes(8, "little") + name) + 8 + len(name) + 4  # past the name and n_dims
    assert int.from_bytes(data[at:at + 8], "little") == 256  # the innermost dimension
    data[at:at + 8] = (288).to_bytes(8, "little")
    rows.write_bytes(bytes(data))
    cases = {
        "layers": (_write(tmp_path / "layers.gguf", plain, block_count=100000),
                   "qwen2.block_count is 100000, but it holds tensors for 2 layers"),
        "rows": (rows, "tensor blk.1.ffn_down.weight has rows of 288 values, not a multiple of Q4_K's block of 256"),
    }
    for path, message in cases.values():
        with pytest.raises(ValueError, match=f"is a corrupt GGUF file: {message}"):
            read_gguf_info(path)
        with pytest.raises(ValueError, match="corrupt GGUF file"):
            gguf_file._info_by_gguf(path)
    assert read_gguf_info(_write(tmp_path / "good.gguf", plain, block_count=2)).arch == "qwen2"
