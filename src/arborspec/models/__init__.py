"""Model backends. `make_session` picks one per model: tree attention (`hf.TreeSession`) for transformers with plain KV
caches, STree (`ssm.SSMTreeSession`) for Mamba2 models and Mamba2/attention hybrids (Bamba, NemotronH)."""
from __future__ import annotations


def is_ssm_model(model) -> bool:
    from .ssm import SSM_MODEL_TYPES

    return getattr(model.config, "model_type", None) in SSM_MODEL_TYPES


def make_session(model, role: str = "target", ssm_tree: str = "packed", **opts):
    """A fresh tree session for `model`: SSMTreeSession for Mamba2 / hybrids (`ssm_tree` 'packed' or 'unrolled'),
    TreeSession otherwise (where `ssm_tree` is ignored)."""
    if is_ssm_model(model):
        from .ssm import SSMTreeSession

        return SSMTreeSession(model, role, ssm_tree=ssm_tree, **opts)
    from .hf import TreeSession

    return TreeSession(model, role)


def check_session_support(model) -> None:
    """Raise ValueError (with a hint) unless one of the backends can run `model`."""
    if is_ssm_model(model):
        from .ssm import check_ssm_support

        return check_ssm_support(model)
    from .hf import check_cache_support
    from .ssm import SSM_MODEL_TYPES

    try:
        check_cache_support(model)
    except ValueError as err:
        raise ValueError(f"{err}; the state-space backend (STree) supports model types "
                         f"{', '.join(SSM_MODEL_TYPES)}") from None
