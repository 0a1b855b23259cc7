"""Random GGUF weight blocks, byte by byte, for the kernels' tests and tiny K-quant models.

`gguf.quants` cannot quantize to the K-quant types, so tests write blocks directly: random quant bits and scale
bytes (every bit pattern is a valid block), with float16 super-scales drawn so that the dequantized weights have
roughly the magnitude asked for.
"""
from __future__ import annotations

import numpy as np
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as QT

KINDS = (QT.Q4_K, QT.Q6_K, QT.Q5_0, QT.Q8_0, QT.Q4_0, QT.IQ4_NL)

# the largest |integer weight x integer scale| a block can hold, to turn a wanted magnitude into a super-scale
_SPAN = {QT.Q4_K: 15 * 63, QT.Q6_K: 32 * 127, QT.Q5_0: 16, QT.Q8_0: 127, QT.Q4_0: 8, QT.IQ4_NL: 127}


def random_blocks(qtype, n: int, k: int, rng: np.random.Generator, magnitude: float = 1.0) -> np.ndarray:
    """(n, row_bytes) uint8: n rows of k weights in GGUF type `qtype`, weights up to ~`magnitude` in size."""
    qtype = QT(qtype)
    block, nbytes = GGML_QUANT_SIZES[qtype]
    assert k % block == 0, (k, block)
    count = n * (k // block)
    raw = rng.integers(0, 256, size=(count, nbytes), dtype=np.uint8)
    scale = (magnitude / _SPAN[qtype] * rng.uniform(0.25, 1.0, size=count)).astype(np.float16)
    halves = scale.view(np.uint8).reshape(count, 2)
    if qtype == QT.Q4_K:  # d, dmin (float16) first; mins kept smaller so weights are not all negative
        raw[:, 0:2] = halves
        raw[:, 2:4] = (scale * np.float16(0.5)).view(np.uint8).reshape(count, 2)
    elif qtype == QT.Q6_K:  # ql[128], qh[64], scales[16] (int8), d (float16) last
        raw[:, 208:210] = halves
    else:  # Q5_0, Q8_0, Q4_0, IQ4_NL: d (float16) first
        raw[:, 0:2] = halves
    return raw.reshape(n, k // block * nbytes)
