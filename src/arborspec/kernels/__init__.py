"""arborspec's own matrix kernels for GGUF weights: Y = X · Wᵀ with W kept in its GGUF blocks, for small M.

Why: verifying a tree of n tokens should cost about one token's memory time (the weights stream from memory once and
are applied to every row), and no CPU kernel we can call does that for n = 2..16 (docs/kernels.md). `QuantMatrix`
is the one entry point; `matrix.py` holds it, `build.py` compiles `gguf_mm.cpp` and `forward.cpp` for this CPU, `reference.py` is the
scalar reference the tests hold the kernels to.
"""
from .matrix import SUPPORTED_TYPES, QuantMatrix, supported

__all__ = ["QuantMatrix", "SUPPORTED_TYPES", "supported"]
