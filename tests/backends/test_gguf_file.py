"""The GGUF header reader (backends/gguf_file.py): what it reports equals what gguf's own reader reports, without
gguf's reader for a readable file, and a file it cannot read gets gguf's one-line error."""
from __future__ import annotations

import gguf
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
