"""Free branches from the context: prompt-lookup n-grams grafted onto any drafted tree.

If the last `n` committed tokens occurred earlier in the context, the tokens that followed them then are a cheap
guess for what follows now (prompt lookup decoding; code and quoting repeat a lot). The guess costs no draft call:
it is added to the tree as a chain under the root, merged with drafted nodes where the tokens coincide.

These children are chosen deterministically, so a node that receives one is marked DETERMINISTIC: only verifiers that
are exact for any tree (greedy, naive) may verify such a tree, and the engine refuses the others.
"""
from __future__ import annotations

from ...core.tree import DrawRule, TokenTree


def lookup(context: list[int], max_ngram: int, length: int) -> list[int]:
    """Tokens that followed the most recent earlier occurrence of the context's last n-gram (n = max_ngram .. 1)."""
    for n in range(min(max_ngram, len(context) - 1), 0, -1):
        tail = context[-n:]
        for start in range(len(context) - n - 1, -1, -1):  # most recent first, excluding the tail itself
            if context[start : start + n] == tail:
                follow = context[start + n : start + n + length]
                if follow:
                    return follow
    return []


def graft(tree: TokenTree, tokens: list[int], source: str = "ngram", under: int = 0) -> list[int]:
    """Add `tokens` as a chain under node `under` (the root by default), reusing existing children (credited to
    whoever proposed them first, core/tree.py); new nodes are credited to `source`. Returns the chain's node indices."""
    node, chain = under, []
    kids = tree.children_lists()
    for tok in tokens:
        match = next((c for c in kids[node] if tree.tokens[c] == tok), None) if node < len(kids) else None
        if match is None:
            dist = tree.child_dist.get(node)
            prob = float(dist[tok]) if dist is not None else 0.0
            match = tree.add(node, tok, prob, source)
            tree.child_rule[node] = DrawRule.DETERMINISTIC  # an extra, deterministically chosen child
        else:
            tree.propose_again(match, source)
        node = match
        chain.append(node)
    return chain


def add_ngram_branch(tree: TokenTree, context: list[int], max_ngram: int, length: int) -> TokenTree:
    """Graft the prompt-lookup continuation of `context` onto `tree` (at most `length` tokens deep)."""
    if max_ngram > 0 and length > 0:
        graft(tree, lookup(context, max_ngram, length))
    return tree
