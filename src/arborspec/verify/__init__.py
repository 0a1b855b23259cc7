"""Verification rules, by name. A new rule is one module here plus one line in VERIFIERS."""
from .asps import ASpSVerifier
from .base import Verdict, Verifier, fits
from .greedy import GreedyVerifier
from .mbr import MBRVerifier
from .mss import MSSVerifier
from .naive import NaiveVerifier
from .sps import SpSVerifier
from .wetap import WETAPVerifier

VERIFIERS: dict[str, type[Verifier]] = {
    "greedy": GreedyVerifier,
    "sps": SpSVerifier,
    "asps": ASpSVerifier,
    "mss": MSSVerifier,
    "mbr": MBRVerifier,
    "naive": NaiveVerifier,
    "wetap": WETAPVerifier,
}

__all__ = ["VERIFIERS", "Verifier", "Verdict", "fits"]
