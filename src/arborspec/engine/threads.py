"""How many torch threads a step runs on.

llama.cpp (and the native kernels) run their own thread pool; the torch work around their calls (logits checks,
warps, verifiers) is small, and on a 2-core CPU torch's second thread only fights those threads for the cores
(measured ~10% of a plain step). So with no torch model in the loop, torch keeps to one thread during a step.
"""
from __future__ import annotations

from contextlib import contextmanager

import torch


def step_threads(models: list) -> int | None:
    """torch's threads for a step over `models` (the ones the loop calls): 1 without a torch model, else None
    (unchanged: a torch model's forward wants them all)."""
    return None if any(isinstance(m, torch.nn.Module) for m in models) else 1


@contextmanager
def torch_threads(n: int | None):
    """torch on `n` intra-op threads inside the block (None: unchanged); restored after, also on errors."""
    before = torch.get_num_threads()
    if n is not None and n != before:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        if n is not None and n != before:
            torch.set_num_threads(before)
