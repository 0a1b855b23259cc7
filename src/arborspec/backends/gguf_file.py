"""A GGUF file's header: its metadata and tensor table, read without its tensor data or its vocabulary strings.

gguf's own `GGUFReader` builds Python objects for every vocabulary entry: a Qwen2.5 file's 150k tokens and 150k merges
took ~6-10 s and ~0.5 GB while the reader lived (Zen 4), and llama.cpp's backend read every file with it before
loading it. Both GGUF backends need the scalar metadata and the tensor table only: `read_gguf` walks them in ~0.05 s,
skipping arrays (their length is kept: the vocabulary size). gguf's reader still words the error for a file this one
cannot read (`read_gguf_info`).
"""
from __future__ import annotations

import functools
import re
import struct
from collections import Counter
from dataclasses import dataclass
from math import isfinite, prod
from pathlib import Path

import gguf
import numpy as np
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as QT

_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


@dataclass(frozen=True)
class GgufTensor:
    name: str
    shape: tuple[int, ...]  # torch order: (rows n, row length k) for a matrix
    qtype: QT
    path: Path
    offset: int  # of its bytes in the file
    nbytes: int

    def read(self) -> np.ndarray:
        """Its bytes (uint8), read into memory of their own: a file read, not a map, so the process never holds
        the file's pages and a copy of them at once (the kernels keep their own, maybe repacked, copy)."""
        return np.fromfile(self.path, dtype=np.uint8, count=self.nbytes, offset=self.offset)

    @property
    def part(self) -> str:
        """"attn_q" for "blk.3.attn_q.weight", "output" for "output.weight"."""
        return self.name.split(".")[-2]


@dataclass(frozen=True)
class GgufFile:
    metadata: dict  # key -> value; an array's value is its length
    tensors: list[GgufTensor]


class _Cursor:
    """Reads little-endian GGUF values from a byte buffer, front to back. Through a memoryview: slicing the memmap
    itself made an array object per string, and a Qwen2.5 file's vocabulary and merges hold ~300k strings (0.58 s
    a file, 0.03 s now; arrays of strings are walked, not decoded, since only their lengths are kept; the
    vocabulary's strings are also compared for a repeat: `_repeated_string`, +0.07 s)."""

    def __init__(self, blob: np.ndarray):
        self.blob, self.pos = memoryview(blob), 0

    def take(self, fmt: str) -> tuple:
        values = struct.unpack_from(fmt, self.blob, self.pos)
        self.pos += struct.calcsize(fmt)
        return values

    def string(self) -> str:
        (length,) = self.take("<Q")
        self.pos += length
        return bytes(self.blob[self.pos - length:self.pos]).decode("utf-8")

    def skip_strings(self, count: int) -> None:
        pos, blob = self.pos, self.blob
        for _ in range(count):
            pos += 8 + struct.unpack_from("<Q", blob, pos)[0]
        self.pos = pos

    def value(self, kind: int):
        if kind in _SCALARS:
            return self.take(_SCALARS[kind])[0]
        if kind == _STRING:
            return self.string()
        if kind != _ARRAY:
            raise ValueError(f"unknown GGUF value type {kind}")
        item, count = self.take("<IQ")
        if item in _SCALARS:
            self.pos += count * struct.calcsize(_SCALARS[item])
        elif item == _STRING:
            self.skip_strings(count)
        else:  # nested arrays have their own lengths: walk them
            for _ in range(count):
                self.value(item)
        return ArrayLength(count)


class ArrayLength(int):
    """An array's value in `GgufFile.metadata`: its length, marked as one (a per-layer head count is an array). The
    vocabulary's also says which token string it holds twice, if any (`repeated`)."""

    repeated: str | None = None


def _repeated_string(blob, pos: int) -> str | None:
    """The first string an array of strings at `pos` (type, count, then length-prefixed strings) holds twice, else
    None: llama.cpp aborts the process on a vocabulary with a repeated token (0.07 s for Qwen2.5's 151k tokens)."""
    item, count = struct.unpack_from("<IQ", blob, pos)
    if item != _STRING:
        return None
    seen, pos = set(), pos + 12
    for _ in range(count):
        (length,) = struct.unpack_from("<Q", blob, pos)
        text = bytes(blob[pos + 8:pos + 8 + length])
        if text in seen:
            return text.decode("utf-8", "replace")
        seen.add(text)
        pos += 8 + length
    return None


def read_gguf(path: Path) -> GgufFile:
    """The file's metadata and tensor table (no tensor data is read); ValueError or struct.error for a file that is
    not a whole GGUF v2/v3. Read once per file version: loading the default pair read its three files five times
    (0.1 s each for the 1.5B target with the vocabulary check), so the result is kept for the same path, size and
    mtime. Callers must not change it."""
    stat = Path(path).stat()
    return _read_gguf(Path(path).resolve(), stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=8)
def _read_gguf(path: Path, size: int, mtime_ns: int) -> GgufFile:
    blob = np.memmap(path, mode="r", dtype=np.uint8)
    cursor = _Cursor(blob)
    magic, version, n_tensors, n_values = cursor.take("<4sIQQ")
    if magic != b"GGUF" or version not in (2, 3):
        raise ValueError(f"not a GGUF v2/v3 file (magic {magic!r}, version {version})")
    metadata = {}
    for _ in range(n_values):
        key, (kind,) = cursor.string(), cursor.take("<I")
        start = cursor.pos
        metadata[key] = cursor.value(kind)
        if key == "tokenizer.ggml.tokens" and isinstance(metadata[key], ArrayLength):
            metadata[key].repeated = _repeated_string(cursor.blob, start)
    table = []
    for _ in range(n_tensors):
        name = cursor.string()
        (dims,) = cursor.take("<I")
        shape = tuple(reversed(cursor.take(f"<{dims}Q")))  # the file lists the innermost dimension first
        kind, offset = cursor.take("<IQ")
        table.append((name, shape, QT(kind), offset))
    names = [name for name, *_ in table]
    if len(set(names)) < len(names):  # the later copy won in silence
        raise ValueError(f"tensor {next(n for n in names if names.count(n) > 1)} appears twice in the tensor table")
    align = int(metadata.get("general.alignment", 32))
    if align < 1 or align & (align - 1):
        raise ValueError(f"general.alignment {align} is not a power of two")
    start = -(-cursor.pos // align) * align  # tensor data begins at the next aligned offset
    tensors = []
    for name, shape, qtype, offset in table:
        block, block_bytes = GGML_QUANT_SIZES[qtype]
        begin, size = start + offset, prod(shape) // block * block_bytes
        if begin + size > len(blob):
            raise ValueError(f"tensor {name} ends past the end of the file")
        tensors.append(GgufTensor(name, shape, qtype, path, begin, size))
    return GgufFile(metadata, tensors)


@dataclass(frozen=True)
class GgufInfo:
    """What arborspec checks in a GGUF before llama.cpp reads it (llama.cpp aborts the process on some bad files)."""

    arch: str
    context_length: int | None  # the trained context, <arch>.context_length
    weight_type: str  # e.g. "Q4_K_M" (general.file_type), else the most common 2-D tensor type
    embedding_model: bool  # pooling / non-causal attention: an encoder for embeddings, not a causal LM


def read_gguf_info(path: Path) -> GgufInfo:
    """`path`'s GgufInfo; ValueError (one line) unless it is a whole, readable model GGUF. Tensor data is not read,
    only checked to lie inside the file."""
    try:
        file = read_gguf(path)
    except Exception:  # gguf's reader words why (or reads what this one does not)
        return _info_by_gguf(path)
    return describe(path, file)


def describe(path: Path, file: GgufFile) -> GgufInfo:
    """The GgufInfo of a file `read_gguf` has read; ValueError if it is no model."""
    info = _info(path, file.metadata.get, [(t.name, t.shape, t.qtype) for t in file.tensors])
    _check_vectors(path, file.tensors)
    return info


_FLOATS = {QT.F32: np.float32, QT.F16: np.float16}


def _check_vectors(path: Path, tensors: list[GgufTensor]) -> None:
    """ValueError for a NaN or inf in a float vector (norm weights, biases). On llama.cpp such a file ran and wrote
    garbage: it quantizes activations to 8 bits for its quantized products, which turns NaN into finite numbers, so
    the logits stayed finite (native refused them). The vectors are small: the 1.5B target's 141 are read in
    ~3 ms (Zen 4); the matrices (hundreds of MB) are not read here."""
    for t in tensors:
        dtype = _FLOATS.get(t.qtype)
        if dtype is not None and len(t.shape) == 1 and not np.isfinite(t.read().view(dtype)).all():
            raise ValueError(f"{path} is a corrupt GGUF file: tensor {t.name} holds a NaN or inf")


def _info(path: Path, field, tensors: list[tuple]) -> GgufInfo:
    """GgufInfo from a metadata lookup `field(key)` (None when absent) and the tensor table's (name, shape outermost
    first, type), whichever reader read the header."""
    arch = field("general.architecture")
    if not isinstance(arch, str) or not tensors:
        raise ValueError(f"{path} has no general.architecture or no tensors: not a model GGUF")
    _check_sizes(path, arch, field)
    _check_values(path, arch, field)
    _check_tensors(path, arch, field, tensors)
    context = field(f"{arch}.context_length")
    return GgufInfo(arch, int(context) if context is not None else None,
                    weight_type(field("general.file_type"), [qt.name for _, shape, qt in tensors if len(shape) == 2]),
                    bool(field(f"{arch}.pooling_type")) or field(f"{arch}.attention.causal") is False)


def _check_tensors(path: Path, arch: str, field, tensors: list[tuple]) -> None:
    """ValueError for a tensor table no model can have (a corrupt file): rows that are not whole blocks of their
    type (the size read rounded down in silence, and native failed later naming neither file nor tensor), more
    layers declared than the file holds tensors for (native built every declared layer first: a block_count of
    100000 on a 2-layer file ran out of memory loading, ~3.5 ms a layer), or on qwen2 / llama query rows other than
    the heads times the key size declared (native ran a file that declared 7-wide heads, ignoring it)."""
    for name, shape, qtype in tensors:
        block = GGML_QUANT_SIZES[qtype][0]
        if shape and shape[-1] % block:
            raise ValueError(f"{path} is a corrupt GGUF file: tensor {name} has rows of {shape[-1]} values, not a "
                             f"multiple of {qtype.name}'s block of {block}")
    sizes = _head_sizes(arch, field)
    query = next((shape for name, shape, _ in tensors if name == "blk.0.attn_q.weight"), None)
    if sizes and query:
        heads, key_size = field(f"{arch}.attention.head_count"), sizes["attention.key_length"][0]
        if query[0] != heads * key_size:
            raise ValueError(f"{path} is a corrupt GGUF file: blk.0.attn_q.weight has {query[0]} rows, not "
                             f"{heads} heads x a key size of {key_size}")
    layers = field(f"{arch}.block_count")
    held = {int(name.split(".")[1]) for name, _, _ in tensors if re.fullmatch(r"blk\.\d+\..+", name)}
    if isinstance(layers, (int, np.integer)) and held and layers > max(held) + 1:
        raise ValueError(f"{path} is a corrupt GGUF file: {arch}.block_count is {layers}, but it holds tensors for "
                         f"{max(held) + 1} layers")


SIZES = {"block_count": 1, "attention.head_count": 1, "attention.head_count_kv": 1, "embedding_length": 1,
         "feed_forward_length": 1, "context_length": 2}  # hyper-parameter -> its least usable value


def _check_sizes(path: Path, arch: str, field) -> None:
    """ValueError for a size or a rope base out of range (a corrupt file), before either backend runs it: llama.cpp
    aborted the process on a file with 0 layers (GGML_ASSERT), and native ran a context_length of -5 until its
    first forward. Per-layer values (arrays) are the architecture's own business."""
    for key, low in SIZES.items():
        value = field(f"{arch}.{key}")
        if value is not None and not isinstance(value, (list, ArrayLength)) and (
                isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low):
            raise ValueError(f"{path} is a corrupt GGUF file: {arch}.{key} is {value!r}")
    heads, kv = field(f"{arch}.attention.head_count"), field(f"{arch}.attention.head_count_kv")
    if isinstance(heads, (int, np.integer)) and isinstance(kv, (int, np.integer)) and heads % kv:
        raise ValueError(f"{path} is a corrupt GGUF file: {heads} attention heads do not share {kv} key/value "
                         "heads evenly")
    base = field(f"{arch}.rope.freq_base")
    if base is not None and not (isinstance(base, (int, float, np.number)) and isfinite(base) and base > 0):
        raise ValueError(f"{path} is a corrupt GGUF file: {arch}.rope.freq_base is {base!r}")


WHOLE_HEADS = ("qwen2", "llama")  # architectures whose keys, values and rotary span the same head size


def _number(value) -> bool:
    """A scalar number of the header (not a bool, not an array's length)."""
    return isinstance(value, (int, float, np.number)) and not isinstance(value, (bool, ArrayLength))


def _head_sizes(arch: str, field) -> dict[str, tuple[int, bool]] | None:
    """On qwen2 / llama: the key, value and rotary sizes, each (size, whether the header gives it; absent, it is
    embedding_length / head_count); None for other architectures or without those two sizes."""
    width, heads = field(f"{arch}.embedding_length"), field(f"{arch}.attention.head_count")
    if arch not in WHOLE_HEADS or not (_number(width) and _number(heads) and heads > 0):
        return None
    given = {key: field(f"{arch}.{key}") for key in ("attention.key_length", "attention.value_length",
                                                      "rope.dimension_count")}
    return {key: (width // heads if value is None else value, value is not None) for key, value in given.items()}


def _check_values(path: Path, arch: str, field) -> None:
    """ValueError for header values llama.cpp asserts on (GGML_ASSERT aborted the process, under `--backend auto`
    too) and native read otherwise or failed on later: a norm epsilon that is not a finite number >= 0, experts
    counted inconsistently, a key, value or rotary size other than the head's on qwen2 / llama, a special token id
    outside the vocabulary (native's embedding raised an AssertionError traceback on a padding id past it)."""
    def corrupt(key: str, value, why: str = "") -> ValueError:
        return ValueError(f"{path} is a corrupt GGUF file: {key} is {value!r}{why}")

    for key in (f"{arch}.attention.layer_norm_rms_epsilon", f"{arch}.attention.layer_norm_epsilon"):
        eps = field(key)
        if eps is not None and not (_number(eps) and isfinite(eps) and eps >= 0):
            raise corrupt(key, eps)
    experts, used = field(f"{arch}.expert_count") or 0, field(f"{arch}.expert_used_count") or 0
    if _number(experts) and _number(used) and (used > experts or bool(experts) != bool(used)):  # none of some experts
        raise corrupt(f"{arch}.expert_used_count", used, f" with {arch}.expert_count {experts!r}")
    sizes = _head_sizes(arch, field)
    if sizes and len({size for size, _ in sizes.values()}) > 1:
        said = ", ".join(f"{arch}.{key} {size}" + ("" if given else " (absent)")
                         for key, (size, given) in sizes.items())
        raise ValueError(f"{path} is a corrupt GGUF file: {said} differ ({arch} attends and rotates whole heads of "
                         "one size)")
    tokens = field("tokenizer.ggml.tokens")
    vocab = len(tokens) if isinstance(tokens, list) else tokens
    if isinstance(tokens, list):  # gguf's own reader gives the strings
        repeated = next((t for t, n in Counter(tokens).items() if n > 1), None)
    else:
        repeated = getattr(tokens, "repeated", None)
    if repeated is not None:
        raise ValueError(f"{path} is a corrupt GGUF file: its vocabulary holds the token {repeated!r} twice")
    for name in ("bos", "eos", "padding", "unknown", "separator"):
        key = f"tokenizer.ggml.{name}_token_id"
        token = field(key)
        if vocab and token is not None and not (_number(token) and 0 <= token < vocab):
            raise corrupt(key, token, f", not a token id of its vocabulary of {vocab}")


def check_causal(path: Path, info: GgufInfo) -> None:
    """ValueError for an embedding model (pooling, non-causal attention): both GGUF backends run causal LMs."""
    if info.embedding_model:
        raise ValueError(f"{path} is an embedding model ({info.arch} with pooling / non-causal attention), not a "
                         "causal LM")


def weight_type(file_type, matrix_types: list[str]) -> str:
    """"Q4_K_M" from general.file_type, else the most common matrix type."""
    try:
        return gguf.LlamaFileType(int(file_type)).name.removeprefix("MOSTLY_")
    except (TypeError, ValueError):
        return Counter(matrix_types).most_common(1)[0][0] if matrix_types else "unknown"


def _info_by_gguf(path: Path) -> GgufInfo:
    """GgufInfo through gguf's own reader (slow; see the module docstring), with its one-line errors."""
    try:
        reader = gguf.GGUFReader(path)
    except Exception as exc:  # not a GGUF, or cut short / corrupt (the tensor table does not fit the file)
        reason = str(exc) or type(exc).__name__
        what = "is not a GGUF file" if "magic" in reason else "is a truncated or corrupt GGUF file"
        raise ValueError(f"{path} {what} ({reason})") from None
    size = path.stat().st_size
    if any(t.data_offset + t.n_bytes > size for t in reader.tensors):
        raise ValueError(f"{path} is a truncated GGUF file: its tensors need more bytes than its {size}")

    def field(key: str):
        f = reader.get_field(key)
        return None if f is None else f.contents()

    # gguf lists a tensor's dimensions innermost first
    return _info(path, field, [(t.name, tuple(int(d) for d in reversed(t.shape)), QT(int(t.tensor_type)))
                               for t in reader.tensors])
