"""Sequoia (Chen et al., 2024): a static tree whose shape a dynamic program chooses from an acceptance-rate vector.

Positional acceptance assumption: the target accepts the i-th ranked child of an accepted node with probability p_i
(the events "child i is the one accepted" are disjoint, so sum p_i <= 1), whatever the context. A node whose path
from the root takes the child ranks (i_1, ..., i_d) is then accepted with probability p_{i_1} ... p_{i_d}, and the
expected number of accepted tokens of a tree is the sum of that over its drafted nodes. With g(n) the best value of
a tree of n nodes counting its root as 1,

    g(1) = 1,   g(n) = 1 + max over j >= 1 and sizes n_1..n_j >= 1 with sum n_i = n - 1 of  sum_i p_i g(n_i),

where child i (rank i) roots a subtree of n_i nodes; children are always ranks 1..j (a j-th draw exists only after
j - 1 draws). The inner maximum is a knapsack over ranks, A(j, s) = max_t A(j-1, s-t) + p_j g(t), computed once for
all sizes up to `budget` + 1: O(budget^2 * len(p)).

Drafting follows the shape layer by layer (one draft call per layer): a node with j children in the shape gets the
top-j draft tokens at temperature 0, and above it j children drawn as `draw` says (drafting/layers.py): j samples
without replacement by default (verified by multi-branch rejection, `mbr`), j independent samples (`iid`: `mss`), or
the j-1 most probable draft tokens plus one sample off them (`greedy`: `greedy-draft`). The greedy scheme keeps the
shape's ranks closest to their meaning: the child of rank i < j is the draft's i-th token, as at temperature 0 and as
`arborspec calibrate` measures the vector; only the last rank is a draw. Where sampling runs out of support the
missing ranks' subtrees are dropped.

The vector comes from `--acceptance` (comma-separated), or from a JSON file written by `arborspec calibrate`
(`--acceptance-file`), which measures how often the target's token is the draft's i-th ranked token.
"""
from __future__ import annotations

import json
import numbers
from dataclasses import dataclass

import numpy as np

from ..core.options import check_int, opt
from ..core.tree import MAX_TREE_NODES, DrawRule, TokenTree
from .base import DraftContext, Policy
from .layers import DRAW_HELP, DRAW_RULES, check_draw, draw_children, layer_probs

DEFAULT_ACCEPTANCE = "0.65,0.12,0.05,0.03,0.02,0.015,0.01,0.01"


def parse_acceptance(text: str) -> tuple[float, ...]:
    try:  # an empty item ("0.5,,0.2") is refused, not skipped: the 0.2 moved up a rank
        values = tuple(float(x) for x in str(text).split(","))
    except ValueError:
        raise ValueError(f"acceptance must be a comma-separated list of numbers, got {text!r}") from None
    return check_acceptance(values)


def check_acceptance(values) -> tuple[float, ...]:
    if bad := [v for v in values if isinstance(v, bool) or not isinstance(v, numbers.Real)]:
        raise ValueError(f"acceptance rates must be numbers, got {bad[0]!r}")  # [0.5, "x"] said "could not convert"
    values = tuple(float(v) for v in values)
    if not values or any(not 0 <= v <= 1 for v in values):
        raise ValueError(f"acceptance rates must be a non-empty list of numbers in [0, 1], got {list(values)}")
    if sum(values) > 1 + 1e-6:
        raise ValueError(f"acceptance rates of the ranked children must sum to at most 1, got {sum(values):.4f}")
    if not any(values):  # every tree is then worth one token, and the DP's ties drew a budget-deep chain a step
        raise ValueError("every acceptance rate is 0: no drafted token would ever be accepted, so Sequoia has no "
                         "tree to choose; decode with `ar`, or calibrate with a draft that agrees with the target")
    return values


def load_acceptance_file(path: str) -> tuple[float, ...]:
    try:
        with open(path, encoding="utf-8") as fh:
            data = json.load(fh)
    except OSError as err:
        raise ValueError(f"cannot read acceptance file {path!r}: {err.strerror}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"acceptance file {path!r} is not JSON: {err}") from None
    values = data.get("acceptance") if isinstance(data, dict) else data
    if not isinstance(values, list):
        raise ValueError(f"acceptance file {path!r} has no 'acceptance' list")
    try:
        return check_acceptance(values)
    except ValueError as err:
        raise ValueError(f"acceptance file {path!r}: {err}") from None


def sequoia_values(acceptance, budget: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The DP tables: g (g[n] = best value of an n-node tree), best_j[s], size_of[j, s] (see module doc)."""
    p = np.asarray(acceptance, dtype=np.float64)
    K, N = len(p), budget
    g = np.full(N + 2, -np.inf)
    g[1] = 1.0
    A = np.full((K + 1, N + 1), -np.inf)
    A[0, 0] = 0.0
    size_of = np.zeros((K + 1, N + 1), dtype=np.int64)
    best_j = np.zeros(N + 1, dtype=np.int64)
    for s in range(1, N + 1):
        for j in range(1, min(K, s) + 1):
            t = np.arange(1, s - j + 2)  # size of the rank-j subtree; the other j-1 take >= 1 node each
            cand = A[j - 1, s - t] + p[j - 1] * g[t]
            i = int(np.argmax(cand))
            A[j, s], size_of[j, s] = cand[i], t[i]
        js = A[1 : min(K, s) + 1, s]
        best_j[s] = int(np.argmax(js)) + 1
        g[s + 1] = 1.0 + js.max()
    return g, best_j, size_of


def sequoia_shape(acceptance, budget: int) -> list[list[int]]:
    """Children lists of the best tree with `budget` drafted nodes; node 0 is the root, nodes in BFS order."""
    _, best_j, size_of = sequoia_values(acceptance, budget)

    def child_sizes(n: int) -> list[int]:
        s, j, out = n - 1, (best_j[n - 1] if n > 1 else 0), []
        while j > 0:
            t = int(size_of[j, s])
            out.append(t)
            s, j = s - t, j - 1
        return out[::-1]  # rank 1 first

    kids: list[list[int]] = [[]]
    sizes = [budget + 1]
    queue = [0]
    while queue:
        node = queue.pop(0)
        for size in child_sizes(sizes[node]):
            kids.append([])
            sizes.append(size)
            kids[node].append(len(kids) - 1)
            queue.append(len(kids) - 1)
    return kids


def expected_accepted(kids: list[list[int]], acceptance) -> float:
    """Sum over drafted nodes of the product of p_rank along the path (the DP's objective, root excluded)."""
    total, stack = 0.0, [(0, 1.0)]
    while stack:
        node, w = stack.pop()
        for rank, c in enumerate(kids[node]):
            wc = w * (acceptance[rank] if rank < len(acceptance) else 0.0)
            total += wc
            stack.append((c, wc))
    return total


@dataclass
class SequoiaOptions:
    budget: int = opt(64, "drafted tokens per step (the size of Sequoia's tree)")
    acceptance: str = opt(DEFAULT_ACCEPTANCE, "acceptance rate of the i-th ranked child, comma-separated")
    acceptance_file: str = opt("", "JSON from `arborspec calibrate` (overrides --acceptance)")
    draw: str = opt("sample", DRAW_HELP)

    def __post_init__(self):
        check_int(self.budget, "budget", high=MAX_TREE_NODES)
        check_draw(self.draw)
        if self.acceptance_file:
            self.vector = load_acceptance_file(self.acceptance_file)
        else:
            self.vector = parse_acceptance(self.acceptance)


class SequoiaPolicy(Policy):
    name = "sequoia"
    summary = "Sequoia: the static tree a dynamic program picks from an acceptance-rate vector (--budget)"
    Options = SequoiaOptions

    def __init__(self, **options):
        super().__init__(**options)
        self._shapes: dict[int, tuple[list[list[int]], int]] = {}  # budget -> (shape, depth): budget="auto" varies it

    def _shape(self) -> tuple[list[list[int]], int]:
        budget = self.options.budget
        if budget not in self._shapes:
            shape = sequoia_shape(self.options.vector, budget)
            depth = [0] * len(shape)
            for node, kids in enumerate(shape):
                for c in kids:
                    depth[c] = depth[node] + 1
            self._shapes[budget] = shape, max(depth)
        return self._shapes[budget]

    @property
    def sampled_rule(self) -> DrawRule:
        """How children are drawn when the draft samples (the `draw` option); the default verifier follows it."""
        return DRAW_RULES[self.options.draw]

    @property
    def shape(self) -> list[list[int]]:
        return self._shape()[0]

    @property
    def shape_depth(self) -> int:
        return self._shape()[1]

    @property
    def max_tree_depth(self) -> int:
        return self.shape_depth

    def draft(self, ctx: DraftContext) -> TokenTree:
        shape, shape_depth = self._shape()
        tree = TokenTree.root(ctx.context[-1])
        frontier = [(0, 0)]  # (shape node, tree node)
        for _ in range(min(shape_depth, ctx.max_depth)):
            expand = [(s, n) for s, n in frontier if shape[s]]
            if not expand:
                break
            warped, plain = layer_probs(ctx, tree, [n for _, n in expand])
            frontier = []
            for i, (s, n) in enumerate(expand):
                children = draw_children(ctx, tree, n, warped[i], plain[i], min(len(shape[s]), plain.shape[-1]),
                                         self.options.draw)
                frontier.extend(zip(shape[s], children))
        return tree
