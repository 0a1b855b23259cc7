"""Tree policies, by name. A new policy is one module here plus one line in POLICIES."""
from .ar import AutoregressivePolicy
from .base import DraftContext, Policy
from .chain import ChainPolicy
from .static import StaticPolicy

POLICIES: dict[str, type[Policy]] = {
    "ar": AutoregressivePolicy,
    "chain": ChainPolicy,
    "static": StaticPolicy,
}

__all__ = ["POLICIES", "Policy", "DraftContext"]
