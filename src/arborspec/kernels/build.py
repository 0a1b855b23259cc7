"""Compile the kernels (`gguf_mm.cpp`) for this CPU, once, and load them as torch operators.

Why a torch C++ extension: the kernels split output rows across torch's own thread pool (`at::parallel_for`), so
they never fight torch's threads for the cores (two OpenMP pools spinning on 2 cores cost 10x), and they take and
return tensors without copies. It is compiled on first use (or by `arborspec kernels build`, which the set-up scripts
run) with `-march=native` into the arborspec cache, keyed by the source, the CPU's flags and torch's version, so a
machine never runs code built for another CPU. Nothing prebuilt is downloaded.
"""
from __future__ import annotations

import functools
import hashlib
import os
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("gguf_mm.cpp")


class KernelBuildError(RuntimeError):
    """The kernels could not be compiled here (no C++ compiler, no ninja, ...): the message says what is missing."""


class _Reference:
    """Stand-in while the C++ kernels are being written: the scalar reference (slow, same numerics)."""

    name = "reference"

    def matmul(self, matrix, x: torch.Tensor) -> torch.Tensor:
        from .reference import reference_matmul
        return reference_matmul(matrix, x)


@functools.cache
def library():
    """The loaded kernels (an object with `matmul(matrix, x)`)."""
    if not SOURCE.exists():
        return _Reference()
    raise NotImplementedError


def cache_key() -> str:
    flags = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                flags = line
                break
    except OSError:
        pass
    text = SOURCE.read_bytes() + flags.encode() + torch.__version__.encode()
    return hashlib.sha256(text).hexdigest()[:16]


def build_dir() -> Path:
    from ..cache import cache_dir
    return cache_dir() / "kernels" / cache_key()
