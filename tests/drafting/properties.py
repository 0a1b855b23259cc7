"""Checks every drafted tree must pass, whatever the policy (used by the per-policy property tests)."""
from __future__ import annotations

import torch

from arborspec.core.tree import DrawRule, TokenTree, packed


def brute_ancestors(tree: TokenTree, i: int) -> set[int]:
    out = {i}
    while tree.parents[i] >= 0:
        i = tree.parents[i]
        out.add(i)
    return out


def check_tree(tree: TokenTree, *, budget: int | None = None, max_depth: int | None = None,
               rules: set[DrawRule] | None = None) -> None:
    tree.validate()  # parents first, consistent depths
    if budget is not None:
        assert len(tree) - 1 <= budget, f"{len(tree) - 1} drafted tokens over a budget of {budget}"
    if max_depth is not None:
        assert tree.depth <= max_depth
    kids = tree.children_lists()
    for node, children in enumerate(kids):
        if not children:
            continue
        assert node in tree.child_dist and node in tree.child_rule, f"node {node} has children but no recorded dist"
        rule = tree.child_rule[node]
        if rules is not None:
            assert rule in rules, f"node {node}: rule {rule} not among the policy's {rules}"
        dist = tree.child_dist[node]
        assert dist.dim() == 1 and abs(float(dist.sum()) - 1) < 1e-4
        tokens = [tree.tokens[c] for c in children]
        if rule in (DrawRule.WITHOUT_REPLACEMENT, DrawRule.DETERMINISTIC, DrawRule.GREEDY_TOPK_PLUS_ONE):
            assert len(set(tokens)) == len(tokens), f"node {node}: repeated child tokens {tokens}"
        if rule is not DrawRule.DETERMINISTIC:
            assert all(float(dist[t]) > 0 for t in tokens), "a sampled child outside its distribution's support"
        if rule is DrawRule.GREEDY_TOPK_PLUS_ONE:
            check_greedy_children(dist, tokens, node)
    for order in ("bfs", "dfs", "heavy"):
        out = packed(tree, order)
        out.validate()
        assert sorted(out.tokens) == sorted(tree.tokens)
        mask = out.ancestor_mask()
        for i in range(len(out)):
            assert set(torch.nonzero(mask[i]).flatten().tolist()) == brute_ancestors(out, i)
        for node, rule in out.child_rule.items():
            assert out.child_dist[node] is not None and rule is not None


def check_greedy_children(dist: torch.Tensor, tokens: list[int], node: int) -> None:
    """GREEDY_TOPK_PLUS_ONE as greedy-draft reads it: the children but the last are the most probable tokens of
    `dist` in order, and the last is a token off them (or, once the support is used up, every child is a top one)."""
    support = int((dist > 0).sum())
    top = torch.sort(dist, descending=True).values
    fixed = tokens if len(tokens) == support else tokens[:-1]
    assert [float(dist[t]) for t in fixed] == top[: len(fixed)].tolist(), f"node {node}: {fixed} are not the top tokens"
    assert len(tokens) <= support


def check_recorded_draft(tree: TokenTree, session, ctx) -> int:
    """Every expanded node records the draft's warped distribution at that node (what verifiers read), and every
    drafted token its probability there, under the plain softmax where the children were picked deterministically.
    `session` is a FakeSession (its logits for any path). Returns the number of nodes checked."""
    checked = 0
    for node, children in enumerate(tree.children_lists()):
        if not children:
            continue
        logits = session.logits_for(tuple(ctx.context) + tuple(tree.tokens[i] for i in tree.path(node)[1:]))
        warped = ctx.sampling.probs(logits)
        assert torch.allclose(tree.child_dist[node], warped), f"node {node}: not the warped draft distribution"
        source = logits.softmax(-1) if tree.child_rule[node] is DrawRule.DETERMINISTIC else warped
        got = [tree.probs[c] for c in children]
        want = [float(source[tree.tokens[c]]) for c in children]
        assert torch.allclose(torch.tensor(got), torch.tensor(want), rtol=1e-5), f"node {node}: {got} != {want}"
        checked += 1
    return checked
