"""Verification rules, by name. A new rule is one module here plus one line in VERIFIERS."""
from .asps import ASpSVerifier
from .base import Verdict, Verifier, fits
from .block import BlockVerifier
from .greedy import GreedyVerifier
from .greedy_draft import GreedyDraftVerifier
from .mbr import MBRVerifier
from .mss import MSSVerifier
from .naive import NaiveVerifier
from .sps import SpSVerifier
from .traversal import TraversalVerifier
from .wetap import WETAPVerifier

VERIFIERS: dict[str, type[Verifier]] = {
    "greedy": GreedyVerifier,
    "sps": SpSVerifier,
    "asps": ASpSVerifier,
    "mss": MSSVerifier,
    "mbr": MBRVerifier,
    "naive": NaiveVerifier,
    "block": BlockVerifier,
    "traversal": TraversalVerifier,
    "greedy-draft": GreedyDraftVerifier,
    "wetap": WETAPVerifier,
}

__all__ = ["VERIFIERS", "Verifier", "Verdict", "fits"]
