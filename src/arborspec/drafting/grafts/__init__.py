"""Free branches: tokens guessed without the draft model (prompt lookup, a suffix tree of past text, lookahead's
Jacobi window), grafted onto a drafted tree under one budget (budget.py), behind one object the engine calls
(branches.py: FreeBranches)."""
from .branches import FreeBranches, suffix_nodes

__all__ = ["FreeBranches", "suffix_nodes"]
