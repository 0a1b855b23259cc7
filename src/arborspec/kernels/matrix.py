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
    """

    def __init__(self, data: np.ndarray | torch.Tensor, qtype, n: int, k: int):
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
        self.data = data  # (n, row_bytes) uint8, as in the file

    @property
    def shape(self) -> tuple[int, int]:
        return self.n, self.k

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x (m, k) float32 -> (m, n) float32."""
        from .build import library
        if x.dim() != 2 or x.shape[1] != self.k:
            raise ValueError(f"expected activations (m, {self.k}), got {tuple(x.shape)}")
        x = x.to(torch.float32).contiguous()
        return library().matmul(self, x)

    def dequantize(self) -> torch.Tensor:
        """W (n, k) float32: for tests, embeddings and the reference (not used on the hot path)."""
        from gguf.quants import dequantize
        return torch.from_numpy(dequantize(self.data.numpy(), self.qtype)).reshape(self.n, self.k)

    def rows(self, index: torch.Tensor) -> torch.Tensor:
        """Rows `index` of W dequantized, float32 (len(index), k): an embedding lookup without a float copy of W."""
        from gguf.quants import dequantize
        picked = self.data.index_select(0, index.reshape(-1).to(torch.long)).numpy()
        return torch.from_numpy(dequantize(picked, self.qtype)).reshape(*index.shape, self.k)
