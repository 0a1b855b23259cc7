"""Tree policies, by name. A new policy is one module here plus one line in POLICIES."""
from .ar import AutoregressivePolicy
from .auto import AutoPolicy
from .base import DraftContext, Policy
from .beam import BeamPolicy
from .chain import ChainPolicy
from .dynatree import DynaTreePolicy
from .dyspec import DySpecPolicy
from .dyspec_threshold import DySpecThresholdPolicy
from .grafts.suffix import SuffixPolicy
from .sequoia import SequoiaPolicy
from .static import StaticPolicy
from .wetap import WetapPolicy

POLICIES: dict[str, type[Policy]] = {
    "ar": AutoregressivePolicy,
    "chain": ChainPolicy,
    "static": StaticPolicy,
    "dyspec": DySpecPolicy,
    "dyspec-threshold": DySpecThresholdPolicy,
    "dynatree": DynaTreePolicy,
    "wetap": WetapPolicy,
    "beam": BeamPolicy,
    "sequoia": SequoiaPolicy,
    "auto": AutoPolicy,
    "suffix": SuffixPolicy,
}

__all__ = ["POLICIES", "Policy", "DraftContext"]
