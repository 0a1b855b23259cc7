"""`QuantMatrix`: one GGUF weight matrix (N output rows of K weights) kept as its blocks, applied to small batches."""
from __future__ import annotations

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as QT

SUPPORTED_TYPES = (QT.Q4_K, QT.Q6_K, QT.Q5_0, QT.Q8_0)


def supported(qtype) -> bool:
    return QT(qtype) in SUPPORTED_TYPES


class QuantMatrix:
    """W (n, k) as GGUF blocks: `data` is uint8 of shape (n, k // block * block_bytes), one weight row per row.

    `self(x)` computes x · Wᵀ for x (m, k) float32 -> (m, n) float32, with the activations quantized to 8 bits per
    block as llama.cpp does for these types (so results agree with llama.cpp's numerics, not with a float matmul).

    Q4_K matrices with a multiple of 8 rows are repacked at load into groups of 8 interleaved rows (the same bits,
    rearranged; see gguf_mm.cpp) because that layout needs about half the multiply instructions per row of X;
    `pack=False` keeps the file's layout (an embedding table, whose rows are looked up one by one).
    """

    def __init__(self, data: np.ndarray | torch.Tensor, qtype, n: int, k: int, pack: bool = True):
        self.qtype = QT(qtype)
        if not supported(self.qtype):
            raise ValueError(f"no kernel for GGUF type {self.qtype.name}; covered: "
                             f"{', '.join(t.name for t in SUPPORTED_TYPES)}")
        block, nbytes = GGML_QUANT_SIZES[self.qtype]
        if k % block:
            raise ValueError(f"row length {k} is not a multiple of {self.qtype.name}'s block of {block}")
        self.n, self.k = n, k
        self.row_bytes = k // block * nbytes
        data = torch.as_tensor(np.ascontiguousarray(data)).view(torch.uint8).reshape(n, self.row_bytes)
        self.packed = pack and self.qtype == QT.Q4_K and n % 8 == 0
        # (n, row_bytes) as in the file, or (n / 8, blocks x 1184) interleaved groups
        self.data = _kernels().ops.repack_q4k8(data, k) if self.packed else data
        # how `data` is laid out, as the C++ code names it (gguf_mm.h): the GGUF type, or a packed layout of it
        self.layout = _kernels().layouts["q4k_rows8"] if self.packed else int(self.qtype)

    @classmethod
    def concat(cls, parts: list["QuantMatrix"]) -> "QuantMatrix":
        """One matrix whose rows are `parts`' rows in order (same type and k): several products over the same input
        (q, k, v; gate, up) become one kernel call. Each part is then rebound as a view of its rows of the result,
        so no memory is held twice."""
        first = parts[0]
        if any(p.qtype != first.qtype or p.k != first.k or p.layout != first.layout for p in parts):
            raise ValueError("concat needs matrices of one type, row length and layout")
        whole = cls.__new__(cls)
        whole.qtype, whole.k, whole.row_bytes, whole.packed = first.qtype, first.k, first.row_bytes, first.packed
        whole.layout = first.layout
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
        """x (m, k) float32 -> (m, n) float32; `scalar` runs the portable code instead of AVX2 (tests)."""
        if x.dim() != 2 or x.shape[1] != self.k:
            raise ValueError(f"expected activations (m, {self.k}), got {tuple(x.shape)}")
        x = x.to(torch.float32).contiguous()
        ops = _kernels().ops
        if self.packed:
            return ops.matmul_q4k8(self.data, self.k, x, scalar)
        return ops.matmul(self.data, int(self.qtype), self.k, x, scalar)

    def blocks(self) -> torch.Tensor:
        """W's blocks in the file's layout, (n, row_bytes) uint8."""
        return _kernels().ops.unpack_q4k8(self.data, self.k) if self.packed else self.data

    def dequantize(self) -> torch.Tensor:
        """W (n, k) float32: for tests and the reference (not used on the hot path)."""
        from gguf.quants import dequantize
        return torch.from_numpy(dequantize(self.blocks().numpy(), self.qtype)).reshape(self.n, self.k)

    def rows(self, index: torch.Tensor) -> torch.Tensor:
        """Rows `index` of W dequantized, float32 (*index.shape, k): an embedding lookup without a float copy of W."""
        flat = index.reshape(-1).to(torch.long).contiguous()
        if self.packed:
            from gguf.quants import dequantize
            picked = self.blocks().index_select(0, flat).numpy()
            return torch.from_numpy(dequantize(picked, self.qtype)).reshape(*index.shape, self.k)
        if len(flat) and (int(flat.min()) < 0 or int(flat.max()) >= self.n):
            raise IndexError(f"token ids must lie in [0, {self.n}), got {int(flat.min())}..{int(flat.max())}")
        return _kernels().ops.embedding_rows(self.data, int(self.qtype), self.k, flat).reshape(*index.shape, self.k)


def _kernels():
    from .build import library
    return library()
