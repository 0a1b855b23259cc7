"""Verification rules, by name. A new rule is one module here plus one line in VERIFIERS."""
from .base import Verdict, Verifier
from .greedy import GreedyVerifier

VERIFIERS: dict[str, type[Verifier]] = {
    "greedy": GreedyVerifier,
}

__all__ = ["VERIFIERS", "Verifier", "Verdict"]
