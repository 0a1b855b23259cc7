"""The scalar reference the kernels are held to: the same numerics, written plainly in torch.

A kernel computes, per output and per weight block, (weight block scale x activation block scale) x an exact integer
dot product of the block's quantized weights with the activations quantized to 8 bits. Here the weights are
dequantized with the `gguf` package (llama.cpp's own formulas, independent of our C++), the activations are quantized
and dequantized as the kernels do, and the product is taken in float64: equal to the kernels' result up to float
rounding of the scales (relative ~1e-6), so a kernel that reads one bit of a block wrongly is caught.
"""
from __future__ import annotations

import torch
from gguf import GGMLQuantizationType as QT

# which 8-bit activation format each weight type is paired with (as in llama.cpp): K-quants use 256-value blocks with
# a float32 scale, the 32-block types a 32-value block with a float16 scale
ACTIVATION_BLOCK = {QT.Q4_K: 256, QT.Q6_K: 256, QT.Q5_0: 32, QT.Q8_0: 32, QT.Q4_0: 32, QT.IQ4_NL: 32}


def quantize_activations(x: torch.Tensor, qtype) -> torch.Tensor:
    """x (m, k) float32 -> the float32 values the kernel's 8-bit activations stand for (m, k).

    256-blocks (q8_K): scale d = max/-127 where max is the block's value of largest magnitude (sign kept), q =
    round(x / d) clamped to 127. 32-blocks (q8_0): d = amax / 127, q = round(x / d), d kept as float16.
    Rounding is to nearest, ties to even (what the vector code's rounding instruction does).
    """
    qtype = QT(qtype)
    block = ACTIVATION_BLOCK[qtype]
    m, k = x.shape
    xb = x.reshape(m, k // block, block).to(torch.float32)
    if block == 256:
        idx = xb.abs().argmax(dim=-1, keepdim=True)
        peak = xb.gather(-1, idx)  # (m, blocks, 1), signed
        iscale = torch.where(peak == 0, torch.zeros_like(peak), -127.0 / peak)
        q = torch.round(xb * iscale).clamp(max=127)
        d = torch.where(peak == 0, torch.zeros_like(peak), 1.0 / iscale)
    else:
        amax = xb.abs().amax(dim=-1, keepdim=True)
        d = amax / 127.0
        inv = torch.where(d == 0, torch.zeros_like(d), 1.0 / d)
        q = torch.round(xb * inv)
        d = d.to(torch.float16).to(torch.float32)
    return (q * d).reshape(m, k)


def reference_matmul(matrix, x: torch.Tensor) -> torch.Tensor:
    """x (m, k) float32 · Wᵀ for a kernels.QuantMatrix, float32 (m, n), by dequantizing W with gguf."""
    w = matrix.dequantize().to(torch.float64)  # (n, k)
    xq = quantize_activations(x, matrix.qtype).to(torch.float64)
    return (xq @ w.T).to(torch.float32)
