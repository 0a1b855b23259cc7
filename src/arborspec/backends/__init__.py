"""Model backends. `make_session` picks one per model: tree attention (`hf.TreeSession`) for transformers with plain KV
caches, STree (`ssm.SSMTreeSession`) for Mamba2 models and Mamba2/attention hybrids (Bamba, NemotronH), and the
model's own sessions for a model object that brings them (`model.new_session(role)`: backends that are not torch
modules, e.g. llama.cpp). Every session implements `session.Session`."""
from __future__ import annotations

import itertools

from .hf import TreeSession, check_cache_support, check_tree_attention
from .session import Session
from .ssm import SSM_MODEL_TYPES, SSMTreeSession, check_ssm_support


def brings_sessions(model) -> bool:
    """True for a model object that makes its own sessions (not a torch module: arborspec cannot run it itself)."""
    return hasattr(model, "new_session")


def is_ssm_model(model) -> bool:
    return getattr(model.config, "model_type", None) in SSM_MODEL_TYPES


def make_session(model, role: str = "target", ssm_tree: str = "packed", **opts) -> Session:
    """A fresh tree session for `model`: the model's own for one that brings sessions, SSMTreeSession for Mamba2 /
    hybrids (`ssm_tree` 'packed' or 'unrolled'), TreeSession otherwise (where `ssm_tree` is ignored)."""
    if brings_sessions(model):
        return model.new_session(role)
    if is_ssm_model(model):
        return SSMTreeSession(model, role, ssm_tree=ssm_tree, **opts)
    return TreeSession(model, role)


def check_session_support(model) -> None:
    """Raise ValueError (with a hint) unless one of the backends can run `model`."""
    if brings_sessions(model):
        return None
    check_on_cpu(model)
    if is_ssm_model(model):
        return check_ssm_support(model)
    check_cache_support(model, f"; the state-space backend (STree) supports model types {', '.join(SSM_MODEL_TYPES)}")
    check_tree_attention(model)


def check_on_cpu(model) -> None:
    """ValueError for a torch model with weights off the CPU: the sessions build their tree masks, positions and
    caches as CPU tensors (arborspec is built for CPUs), and a model on another device failed in its first forward
    with torch's "Expected all tensors to be on the same device" (or, on `meta`, "Tensor on device meta is not on the
    expected device cpu!") and a traceback. A model loaded with a `device_map` is judged by it: accelerate's hooks
    bring weights it offloaded to disk (left on `meta` between forwards) to the CPU for each forward, which runs."""
    placed = getattr(model, "hf_device_map", None)
    if placed:
        off = sorted({f"GPU {d}" if isinstance(d, int) else str(d) for d in placed.values()} - {"cpu", "disk"})
    else:
        tensors = itertools.chain(model.parameters(), model.buffers())
        off = sorted({str(t.device) for t in tensors if t.device.type != "cpu"})
    if off:
        name = getattr(getattr(model, "config", None), "_name_or_path", "") or type(model).__name__
        raise ValueError(f"arborspec runs torch models on the CPU, and {name} has weights on {', '.join(off)}: "
                         "move it with model.to('cpu'), or load it with device_map='cpu' (or none)")
