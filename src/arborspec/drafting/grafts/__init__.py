"""Free branches: tokens guessed without the draft model (prompt lookup, a suffix tree of past text, lookahead's
Jacobi window), grafted onto a drafted tree under one budget (budget.py)."""
