"""`QuantMatrix`: one GGUF weight matrix (N output rows of K weights) kept as its blocks, applied to small batches."""
from __future__ import annotations

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as QT

SUPPORTED_TYPES = (QT.Q4_K, QT.Q6_K, QT.Q5_0, QT.Q8_0, QT.Q4_0, QT.IQ4_NL)
# the types with an AVX2 layout of 8 interleaved rows (gguf_mm.cpp: q4_K x8, q6_K x8, x8): on an AVX2-only build the
# 0.5B draft's Q4_0 products ran at ~2x the memory roofline at M = 1 in the file's rows, at ~1.0x in x8; the K-quants'
# extra rows of X cost ~30-45% less (docs/kernels.md)
ROWS8_TYPES = (QT.Q4_K, QT.Q6_K, QT.Q4_0, QT.IQ4_NL, QT.Q5_0, QT.Q8_0)
VNNI_ROWS, AVX2_ROWS = 16, 8  # weight rows a packed group interleaves: x16 (AVX-512 VNNI); x8, q4_K x8 (AVX2)


def supported(qtype) -> bool:
    return QT(qtype) in SUPPORTED_TYPES


class QuantMatrix:
    """W (n, k) as GGUF blocks: `data` is uint8 of shape (n, k // block * block_bytes), one weight row per row.

    `self(x)` computes x · Wᵀ for x (m, k) float32 -> (m, n) float32, with the activations quantized to 8 bits per
    block as llama.cpp does for these types (so results agree with llama.cpp's numerics, not with a float matmul).

    At load the blocks are repacked (the same bits, rearranged; see gguf_mm.cpp) for the best code the build runs:
    where it has AVX-512 VNNI, every type with a multiple of 16 rows into groups of 16 interleaved rows (one 32-bit
    lane of a 512-bit register per row); otherwise, where it has AVX2 and with a multiple of 8 rows, every type into
    groups of 8 (x8: fewer multiply instructions per row of X, and the float scaling once per block for 8 rows).
    `pack=False` keeps the file's layout (an embedding table, whose rows are looked up one by one); `isa` picks the
    layouts of another path than the build's best (benchmarks: "avx2" on a VNNI host); `kernels` is the compiled
    library to run on (tests: the emulated AVX-512 build).
    """

    def __init__(self, data: np.ndarray | torch.Tensor, qtype, n: int, k: int, pack: bool = True, kernels=None,
                 isa: str | None = None):
        self.qtype = QT(qtype)
        if not supported(self.qtype):
            raise ValueError(f"no kernel for GGUF type {self.qtype.name}; covered: "
                             f"{', '.join(t.name for t in SUPPORTED_TYPES)}")
        block, nbytes = GGML_QUANT_SIZES[self.qtype]
        if k % block:
            raise ValueError(f"row length {k} is not a multiple of {self.qtype.name}'s block of {block}")
        self.kernels = kernels if kernels is not None else _kernels()
        self.n, self.k = n, k
        self.row_bytes = k // block * nbytes
        data = torch.as_tensor(np.ascontiguousarray(data)).view(torch.uint8).reshape(n, self.row_bytes)
        # how `data` is laid out, as the C++ code names it (gguf_mm.h): the GGUF type, or a packed layout of it
        self.layout = self._layout(pack, isa or self.kernels.isa)
        self.packed = self.layout != int(self.qtype)
        # (n, row_bytes) as in the file, or (n / rows per group, blocks x group bytes)
        self.data = self.kernels.ops.repack(data, self.layout, k) if self.packed else data

    def _layout(self, pack: bool, isa: str) -> int:
        names = {QT.Q4_K: "q4k", QT.Q6_K: "q6k", QT.Q5_0: "q5_0", QT.Q8_0: "q8_0", QT.Q4_0: "q4_0",
                 QT.IQ4_NL: "iq4_nl"}
        if pack and isa == "avx512vnni" and self.n % VNNI_ROWS == 0:
            return self.kernels.layouts[f"{names[self.qtype]}_rows16"]
        if pack and isa != "scalar" and self.qtype in ROWS8_TYPES and self.n % AVX2_ROWS == 0:
            return self.kernels.layouts[f"{names[self.qtype]}_rows8"]
        return int(self.qtype)

    @classmethod
    def concat(cls, parts: list["QuantMatrix"]) -> "QuantMatrix":
        """One matrix whose rows are `parts`' rows in order (same type, k and layout): several products over the same
        input (q, k, v; gate, up) become one kernel call. Each part is then rebound as a view of its rows of the
        result, so no memory is held twice. (Packed groups never straddle two parts: each part's rows are a whole
        number of groups.)"""
        first = parts[0]
        if any(p.qtype != first.qtype or p.k != first.k or p.layout != first.layout or p.kernels is not first.kernels
               for p in parts):
            raise ValueError("concat needs matrices of one type, row length and layout")
        whole = cls.__new__(cls)
        whole.qtype, whole.k, whole.row_bytes, whole.packed = first.qtype, first.k, first.row_bytes, first.packed
        whole.layout, whole.kernels = first.layout, first.kernels
        whole.n = sum(p.n for p in parts)
        whole.data = torch.cat([p.data for p in parts])
        start = 0
        for p in parts:
            rows = p.data.shape[0]
            p.data = whole.data[start:start + rows]  # a view: the part keeps working on its own rows
            start += rows
        return whole

    @property
    def shape(self) -> tuple[int, int]:
        return self.n, self.k

    @property
    def nbytes(self) -> int:
        return self.data.numel()

    def __call__(self, x: torch.Tensor, scalar: bool = False) -> torch.Tensor:
        """x (m, k) float32 -> (m, n) float32; `scalar` runs the portable code over the same bytes (tests)."""
        if x.dim() != 2 or x.shape[1] != self.k:
            raise ValueError(f"expected activations (m, {self.k}), got {tuple(x.shape)}")
        x = x.to(torch.float32).contiguous()
        return self.kernels.ops.linear(self.data, self.layout, self.k, x, scalar)

    def blocks(self) -> torch.Tensor:
        """W's blocks in the file's layout, (n, row_bytes) uint8."""
        return self.kernels.ops.unpack(self.data, self.layout, self.k) if self.packed else self.data

    def dequantize(self) -> torch.Tensor:
        """W (n, k) float32: for tests and the reference (not used on the hot path)."""
        from gguf.quants import dequantize
        return torch.from_numpy(dequantize(self.blocks().numpy(), self.qtype)).reshape(self.n, self.k)

    def rows(self, index: torch.Tensor) -> torch.Tensor:
        """Rows `index` of W dequantized, float32 (*index.shape, k): an embedding lookup without a float copy of W
        (a packed matrix unpacks only the groups that hold the rows asked for)."""
        flat = index.reshape(-1).to(torch.long).contiguous()
        if len(flat) and (int(flat.min()) < 0 or int(flat.max()) >= self.n):
            raise IndexError(f"token ids must lie in [0, {self.n}), got {int(flat.min())}..{int(flat.max())}")
        blocks, ids = self.data, flat
        if self.packed:
            per = self.n // self.data.shape[0]  # rows per packed group
            groups, inverse = torch.unique(flat // per, return_inverse=True)
            blocks = self.kernels.ops.unpack(self.data.index_select(0, groups).contiguous(), self.layout, self.k)
            ids = (inverse * per + flat % per).contiguous()
        return self.kernels.ops.embedding_rows(blocks, int(self.qtype), self.k, ids).reshape(*index.shape, self.k)


def _kernels():
    from .build import library
    return library()
