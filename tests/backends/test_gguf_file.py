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
    _finish(writer)
    with pytest.raises(ValueError, match=f"is a corrupt GGUF file: qwen2.{key} is"):
        read_gguf_info(tmp_path / "bad.gguf")
    with pytest.raises(ValueError, match=f"is a corrupt GGUF file: qwen2.{key} is"):
        gguf_file._info_by_gguf(tmp_path / "bad.gguf")


EMBEDDING = {"token_embd.weight": (np.zeros((4, 8), np.float32), None, None)}  # name: (array, raw shape, type)
TWO_LAYERS = {**EMBEDDING, "blk.0.attn_norm.weight": (np.ones(8, np.float32), None, None),
              "blk.1.attn_norm.weight": (np.ones(8, np.float32), None, None)}


def _finish(writer: gguf.GGUFWriter) -> None:
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _write(path, tensors: dict, **keys):
    writer = gguf.GGUFWriter(str(path), "qwen2")
    for key, value in keys.items():
        writer.add_uint32(f"qwen2.{key}", value)
    for name, (array, raw_shape, qtype) in tensors.items():
        writer.add_tensor(name, array, raw_shape=raw_shape, raw_dtype=qtype)
    _finish(writer)
    return path


def test_a_tensor_table_no_model_can_have_is_a_corrupt_file_for_both_readers(tmp_path):
    """Refused when the header is read: rows that are not whole blocks (the size read rounded down in silence and
    native failed later naming neither file nor tensor), and more layers declared than the file holds (native built
    every declared one first: a block_count of 100000 ran out of memory)."""
    # a Q4_K matrix of 2 rows of 256 values (144 bytes each), its rows then said to hold 288: not whole blocks
    q4k = {"blk.1.ffn_down.weight": (np.zeros((2, 144), np.uint8), (2, 144), gguf.GGMLQuantizationType.Q4_K)}
    rows = _write(tmp_path / "rows.gguf", {**TWO_LAYERS, **q4k}, block_count=2)
    data = bytearray(rows.read_bytes())
    name = b"blk.1.ffn_down.weight"
    at = data.index(len(name).to_bytes(8, "little") + name) + 8 + len(name) + 4  # past the name and n_dims
    assert int.from_bytes(data[at:at + 8], "little") == 256  # the innermost dimension
    data[at:at + 8] = (288).to_bytes(8, "little")
    rows.write_bytes(bytes(data))
    cases = {
        "layers": (_write(tmp_path / "layers.gguf", TWO_LAYERS, block_count=100000),
                   "qwen2.block_count is 100000, but it holds tensors for 2 layers"),
        "rows": (rows, "tensor blk.1.ffn_down.weight has rows of 288 values, not a multiple of Q4_K's block of 256"),
    }
    for path, message in cases.values():
        with pytest.raises(ValueError, match=f"is a corrupt GGUF file: {message}"):
            read_gguf_info(path)
        with pytest.raises(ValueError, match="corrupt GGUF file"):
            gguf_file._info_by_gguf(path)
    assert read_gguf_info(_write(tmp_path / "good.gguf", TWO_LAYERS, block_count=2)).arch == "qwen2"


GOOD = {"qwen2.attention.layer_norm_rms_epsilon": 1e-6, "qwen2.embedding_length": 256, "qwen2.attention.head_count": 4,
        "tokenizer.ggml.tokens": gguf_file.ArrayLength(261), "tokenizer.ggml.eos_token_id": 260}


@pytest.mark.parametrize("changes,message", [
    ({"qwen2.attention.layer_norm_rms_epsilon": -1.0}, "qwen2.attention.layer_norm_rms_epsilon is -1.0"),
    ({"qwen2.attention.layer_norm_epsilon": float("nan")}, "qwen2.attention.layer_norm_epsilon is nan"),
    ({"qwen2.expert_count": 4}, "qwen2.expert_used_count is 0 with qwen2.expert_count 4"),
    ({"qwen2.expert_used_count": 2}, "qwen2.expert_used_count is 2 with qwen2.expert_count 0"),
    ({"qwen2.expert_count": 2, "qwen2.expert_used_count": 4}, "qwen2.expert_used_count is 4"),
    ({"qwen2.attention.key_length": 7}, r"qwen2.attention.key_length 7, qwen2.attention.value_length 64 \(absent\)"),
    ({"qwen2.rope.dimension_count": 0}, r"qwen2.attention.key_length 64 \(absent\), .*rope.dimension_count 0 differ"),
    ({"tokenizer.ggml.padding_token_id": 10**6}, "tokenizer.ggml.padding_token_id is 1000000, not a token id of its "
                                                 "vocabulary of 261"),
    ({"tokenizer.ggml.eos_token_id": -5}, "tokenizer.ggml.eos_token_id is -5"),
    ({"tokenizer.ggml.bos_token_id": 261}, "tokenizer.ggml.bos_token_id is 261, not a token id"),  # ids are 0..260
])
def test_header_values_llamacpp_aborts_on_are_a_corrupt_file(changes, message):
    """llama.cpp aborted the process on each (GGML_ASSERT, under --backend auto too); native ignored some and raised
    an AssertionError traceback on a padding id past the vocabulary."""
    with pytest.raises(ValueError, match=f"m.gguf is a corrupt GGUF file: {message}"):
        gguf_file._check_values("m.gguf", "qwen2", {**GOOD, **changes}.get)


def test_header_values_of_real_shapes_pass():
    gguf_file._check_values("m.gguf", "qwen2", GOOD.get)
    gguf_file._check_values("m.gguf", "qwen2", {**GOOD, "qwen2.expert_count": 8, "qwen2.expert_used_count": 2}.get)
    nemo = {"llama.embedding_length": 5120, "llama.attention.head_count": 32, "llama.attention.key_length": 128,
            "llama.attention.value_length": 128, "llama.rope.dimension_count": 128}  # heads narrower than width / heads
    gguf_file._check_values("m.gguf", "llama", nemo.get)


def test_declared_head_sizes_must_be_the_query_rows_and_the_table_whole(tmp_path):
    """A file that declared 7-wide heads on 64-wide weights ran on native (it ignored the keys); a tensor named twice
    loaded with the later copy; an alignment of 3 was read as if it were one."""
    u32 = gguf.GGUFValueType.UINT32
    narrow = write_tiny_gguf(tmp_path / "narrow.gguf", dtype="mixed", extra={
        f"qwen2.{key}": (7, u32) for key in ("attention.key_length", "attention.value_length", "rope.dimension_count")})
    for read in (read_gguf_info, gguf_file._info_by_gguf):
        with pytest.raises(ValueError, match=r"blk.0.attn_q.weight has \d+ rows, not \d+ heads x a key size of 7"):
            read(narrow)
    data = write_tiny_gguf(tmp_path / "good.gguf").read_bytes()
    twice = tmp_path / "twice.gguf"
    twice.write_bytes(data.replace(b"blk.1.attn_norm.weight", b"blk.0.attn_norm.weight"))
    with pytest.raises(ValueError, match="tensor blk.0.attn_norm.weight appears twice"):
        read_gguf(twice)
    with pytest.raises(ValueError, match="corrupt GGUF file"):
        read_gguf_info(twice)
    odd = write_tiny_gguf(tmp_path / "odd.gguf", extra={"general.alignment": (3, u32)})
    with pytest.raises(ValueError, match="general.alignment 3 is not a power of two"):
        read_gguf(odd)


def test_a_vocabulary_with_a_repeated_token_is_a_corrupt_file_for_both_readers(tmp_path):
    """llama.cpp aborted the process on it (GGML_ASSERT: id_to_token.size() == token_to_id.size())."""
    from .tiny_gguf import TOKENS
    data = write_tiny_gguf(tmp_path / "good.gguf").read_bytes()
    first, second = [t.encode() for t in TOKENS if len(t.encode()) == 1][:2]
    vocab = data.index(b"tokenizer.ggml.tokens")
    at = data.index(len(second).to_bytes(8, "little") + second, vocab) + 8
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(data[:at] + first + data[at + 1:])
    assert read_gguf(tmp_path / "good.gguf").metadata["tokenizer.ggml.tokens"].repeated is None
    for read in (read_gguf_info, gguf_file._info_by_gguf):
        with pytest.raises(ValueError, match=f"its vocabulary holds the token {first.decode()!r} twice"):
            read(bad)


def test_a_file_is_read_once_per_version(tmp_path):
    """Loading the default pair read its three files five times; a file written again is read again."""
    path = write_tiny_gguf(tmp_path / "m.gguf")
    first = read_gguf(path)
    assert read_gguf(path) is first and read_gguf(tmp_path / "." / "m.gguf") is first
    write_tiny_gguf(path, layers=3)
    again = read_gguf(path)
    assert again is not first and again.metadata["qwen2.block_count"] == 3


@pytest.mark.parametrize("name,value", [("blk.0.attn_norm.weight", np.nan), ("blk.1.attn_q.bias", np.inf)])
def test_a_nan_or_inf_in_a_float_vector_is_a_corrupt_file(tmp_path, name, value):
    """llama.cpp ran such a file and wrote garbage: its 8-bit activations turn NaN into finite numbers."""
    path = write_tiny_gguf(tmp_path / "m.gguf")
    tensor = next(t for t in read_gguf(path).tensors if t.name == name)
    assert tensor.qtype == gguf.GGMLQuantizationType.F32 and len(tensor.shape) == 1
    read_gguf_info(path)  # the file as written passes
    data = bytearray(path.read_bytes())
    data[tensor.offset + 4:tensor.offset + 8] = np.float32(value).tobytes()  # its second value
    path.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=f"corrupt GGUF file: tensor {name} holds a NaN or inf"):
        read_gguf_info(path)


def test_arrays_of_any_item_size_are_skipped_whole(tmp_path):
    """Only an array's length is kept: the keys and the tensor table after arrays of 1- and 8-byte numbers, of
    strings and of arrays still read as gguf's reader reads them (the tiny files' arrays hold 4-byte items only)."""
    kind = gguf.GGUFValueType
    writer = gguf.GGUFWriter(str(tmp_path / "m.gguf"), "qwen2")
    writer.add_key_value("test.u8", [1, 2, 3], kind.ARRAY, sub_type=kind.UINT8)
    writer.add_key_value("test.u64", [1, 2], kind.ARRAY, sub_type=kind.UINT64)
    writer.add_key_value("test.f64", [0.5], kind.ARRAY, sub_type=kind.FLOAT64)
    writer.add_key_value("test.strings", ["a", "bcd"], kind.ARRAY, sub_type=kind.STRING)
    writer.add_array("test.nested", [[1, 2], [3]])
    writer.add_uint32("qwen2.after", 7)
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    _finish(writer)
    file = read_gguf(tmp_path / "m.gguf")
    lengths = {key: file.metadata[key] for key in ("test.u8", "test.u64", "test.f64", "test.strings", "test.nested")}
    assert lengths == {"test.u8": 3, "test.u64": 2, "test.f64": 1, "test.strings": 2, "test.nested": 2}
    assert all(isinstance(n, gguf_file.ArrayLength) for n in lengths.values())
    assert file.metadata["qwen2.after"] == 7
    reader = gguf.GGUFReader(tmp_path / "m.gguf")
    assert [(t.name, t.shape, t.offset) for t in file.tensors] == [
        (t.name, (4, 8), t.data_offset) for t in reader.tensors]


def test_only_a_v2_or_v3_gguf_is_read(tmp_path):
    """A v1 file's strings have 4-byte lengths: read as v3 it would give garbage, so it is refused up front."""
    data = bytearray(write_tiny_gguf(tmp_path / "m.gguf").read_bytes())
    assert data[:4] == b"GGUF" and int.from_bytes(data[4:8], "little") == 3
    data[4:8] = (1).to_bytes(4, "little")
    (tmp_path / "v1.gguf").write_bytes(bytes(data))
    with pytest.raises(ValueError, match="not a GGUF v2/v3 file .* version 1"):
        read_gguf(tmp_path / "v1.gguf")


def test_an_alignment_of_zero_is_refused_not_divided_by(tmp_path):
    odd = write_tiny_gguf(tmp_path / "zero.gguf", extra={"general.alignment": (0, gguf.GGUFValueType.UINT32)})
    with pytest.raises(ValueError, match="general.alignment 0 is not a power of two"):
        read_gguf(odd)


def test_a_nan_in_a_float16_vector_is_a_corrupt_file(tmp_path):
    """The tiny files keep vectors F32; a converter may write them F16, and those are checked too."""
    norm = np.ones(8, np.float16)
    norm[3] = np.nan
    path = _write(tmp_path / "m.gguf", {**EMBEDDING, "blk.0.attn_norm.weight": (norm, None, None)}, block_count=1)
    assert read_gguf(path).tensors[1].qtype == gguf.GGMLQuantizationType.F16
    with pytest.raises(ValueError, match="tensor blk.0.attn_norm.weight holds a NaN or inf"):
        read_gguf_info(path)


def test_only_vectors_are_read_for_the_nan_check(tmp_path, monkeypatch):
    """The matrices (hundreds of MB on a real model) are not read when the header is checked."""
    path = write_tiny_gguf(tmp_path / "m.gguf")
    read = []
    original = gguf_file.GgufTensor.read
    monkeypatch.setattr(gguf_file.GgufTensor, "read", lambda self: read.append(self.shape) or original(self))
    read_gguf_info(path)
    assert read and all(len(shape) == 1 for shape in read)


def test_one_layer_more_than_the_file_holds_is_a_corrupt_file(tmp_path):
    with pytest.raises(ValueError, match="qwen2.block_count is 3, but it holds tensors for 2 layers"):
        read_gguf_info(_write(tmp_path / "three.gguf", TWO_LAYERS, block_count=3))


def test_a_file_without_layer_tensors_is_not_checked_for_layers(tmp_path):
    """No blk.* tensor: nothing to count layers by, so block_count stands (no error from an empty max())."""
    path = _write(tmp_path / "m.gguf", EMBEDDING, block_count=2)
    assert read_gguf_info(path).arch == "qwen2"


def test_the_least_usable_sizes_pass(tmp_path):
    """One layer, one head, a context of 2 (SIZES' floors), an integer rope base, a zero norm epsilon."""
    sizes = {f"qwen2.{key}": low for key, low in gguf_file.SIZES.items()}
    gguf_file._check_sizes("m.gguf", "qwen2", {**sizes, "qwen2.rope.freq_base": 10000}.get)
    gguf_file._check_values("m.gguf", "qwen2", {**GOOD, "qwen2.attention.layer_norm_rms_epsilon": 0.0}.get)
    with pytest.raises(ValueError, match="qwen2.context_length is 1"):
        gguf_file._check_sizes("m.gguf", "qwen2", {**sizes, "qwen2.context_length": 1}.get)


def test_heads_that_do_not_share_key_value_heads_evenly_are_a_corrupt_file():
    field = {"qwen2.attention.head_count": 6, "qwen2.attention.head_count_kv": 4}.get
    with pytest.raises(ValueError, match="6 attention heads do not share 4 key/value heads evenly"):
        gguf_file._check_sizes("m.gguf", "qwen2", field)
    gguf_file._check_sizes("m.gguf", "qwen2", {"qwen2.attention.head_count": 6, "qwen2.attention.head_count_kv": 3}.get)


def test_query_rows_are_checked_against_heads_times_key_size_not_the_width(tmp_path):
    """Heads narrower than width / heads (as Mistral Nemo's): a query of 4 heads x 8 = 32 rows on a 64-wide model is
    whole; 33 rows is not."""
    keys = {"embedding_length": 64, "attention.head_count": 4, "attention.key_length": 8,
            "attention.value_length": 8, "rope.dimension_count": 8}
    for rows, ok in ((32, True), (33, False)):
        path = _write(tmp_path / f"q{rows}.gguf", {
            "token_embd.weight": (np.zeros((4, 64), np.float32), None, None),
            "blk.0.attn_q.weight": (np.zeros((rows, 64), np.float32), None, None)}, block_count=1, **keys)
        if ok:
            assert read_gguf_info(path).arch == "qwen2"
        else:
            with pytest.raises(ValueError, match="has 33 rows, not 4 heads x a key size of 8"):
                read_gguf_info(path)


def test_weight_type_names_the_file_type_without_mostly_else_the_commonest_matrix_type():
    assert gguf_file.weight_type(15, ["F32"]) == "Q4_K_M"  # gguf.LlamaFileType(15) is MOSTLY_Q4_K_M
    assert gguf_file.weight_type(None, ["Q6_K", "Q4_K", "Q4_K"]) == "Q4_K"
    assert gguf_file.weight_type(None, []) == "unknown"
