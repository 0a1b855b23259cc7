"""One budget for the draft-free sources: grafted rows are kept only where they pay under the measured costs.

n-gram, suffix and lookahead branches (ngram.py, suffix.py, lookahead.py) cost no draft call, but every node they add
is one more row in the target's verification forward, and on a CPU rows are not free (t(n) grows with n). Grafting
them blindly can make a method slower than itself without them. So, per step, each source's branch is grafted onto a
trial copy of the drafted tree and kept only where it raises the step's expected rate:

    (E + gain) / (T - t(1 + N) + t(1 + N + m))  >  E / T

where E and T are the policy's expected tokens and predicted seconds for the tree so far (the auto policy's objective:
auto/objective.py), N its drafted nodes, m the rows kept, t the measured verification curve. Sources are tried in the
engine's order and E, T grow with each branch kept, so later sources must beat the tree as it stands.

In a batching round (backends/batching.py: B requests' trees verified by one forward) a row delays all B requests,
while the round's forward costs far less than B forwards. The costs then count B times the rows (objective.py,
`CostModel.sharing`), so E / T and a branch's extra seconds are the round's, per request. Without this, a branch worth
its rows to one request alone made four batched requests 11% slower than plain batched decoding.

What a branch is expected to gain depends on what its source says about its nodes:
- **Unscored sources** (n-gram, lookahead: one guess per position) are kept or left out whole, with gain = m * a_s,
  a_s the source's acceptance per proposed node, learned online within the request (accepted / proposed, credited
  as core/tree.py credits nodes, with one accepted and one rejected node as the prior, so a source starts at 0.5).
- **Scored sources** (suffix: each node carries its empirical path probability p, a product of count ratios r) are
  cut to their best prefix: nodes come most probable first, parents before children, so every prefix is a tree, and
  the prefix with the highest rate is kept (none, when none beats the tree without it). A node at depth d gains
  p * q_1 * ... * q_d, where q_k is the measured *conditional* acceptance at depth k relative to the count ratio:
  over judged nodes whose parent was accepted (or is the root), accepted / sum of r. Each q_k starts from the one
  above it (q_1 from 1/2) with the weight of one node, so an unexplored depth is as good as the last explored one.
  Why per depth: a continuation seen once scores 1 at every depth, but copies break, so the chance to reach depth d
  falls with d at a rate the text decides; the prefix rule then sizes the branch: long chains while copies hold,
  a node or two where the text is new. Nodes that never had a chance (below a rejected one) teach nothing.

Branches and nodes left out still teach: once the tokens committed after their step decide them, the nodes on the
walk from the root along those tokens count as accepted: what verification would have accepted at T = 0, or with
naive verification at any temperature (the rule grafted trees get), since the committed tokens are the target's own.
A scored node is decided as soon as as many tokens are known as it is deep (or the walk has left the branch), so the
calibration learns from every step; a branch's flat counts once all of it is decided (or `PATIENCE` steps have
passed). So a source that starts to fit the text comes back, even while steps commit one token each, and a scored
source needs no warm-up: it grafts what the prior pays for and learns from the rest. An unscored source that has
proposed fewer than `WARMUP` nodes is kept whole: its acceptance must be measured before it can be judged. Policies
without measured costs (every policy but auto and ar) keep every branch, as asked.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from ...core.tree import TokenTree
from ...verify.base import child_with_token

WARMUP = 16  # nodes a source proposes before its measured acceptance decides
PATIENCE = 16  # steps a left-out branch waits for the tokens that judge it
PRIOR = 0.5  # q_1 before any node is judged; deeper q_k start from q_(k-1) (weight: one node of ratio 1)


@dataclass
class _Graft:
    """A grafted branch whose nodes (all, or those cut off) wait for the committed tokens that judge them."""

    source: str
    trial: TokenTree  # the tree with the whole branch
    first: int  # the branch's first new node in `trial`
    kept: int  # how many of its new nodes went to verification (0: left out)
    start: int  # len(committed) at its step
    step: int  # the step it was grafted at
    scores: dict[int, float] = field(default_factory=dict)  # node -> empirical path probability (scored sources)
    judged: set[int] = field(default_factory=set)  # scored nodes already in the calibration
    kids: list[list[int]] = field(init=False)  # trial's children lists, for the walk at every step until judged

    def __post_init__(self):
        self.kids = self.trial.children_lists()


class GraftBudget:
    """Per request: each draft-free source's measured acceptance and the keep / cut / drop decision for a branch."""

    def __init__(self, costs=None):
        self.costs = costs  # the policy's CostModel (verify(n): seconds of a forward over n tree tokens), or None
        self.proposed: dict[str, int] = {}
        self.accepted: dict[str, int] = {}
        self.dropped: dict[str, int] = {}  # branches left out, for the account
        self.committed: list[int] = []  # every token committed in this generation, in order
        # scored source -> per depth d: [sum of count ratios r of the exposed nodes (parent accepted), accepted]
        self.by_depth: dict[str, list[list[float]]] = {}
        self._pending: list[_Graft] = []
        self._steps = 0

    def acceptance(self, source: str) -> float:
        return (self.accepted.get(source, 0) + 1) / (self.proposed.get(source, 0) + 2)

    def calibration(self, source: str) -> list[float]:
        """q_d for d = 1, 2, ... (the module docstring); deeper than measured: the last one."""
        q, prev = [], PRIOR
        for exposed, hits in self.by_depth.get(source, [])[1:]:
            prev = (hits + prev) / (exposed + 1)
            q.append(prev)
        return q or [PRIOR]

    def reach(self, source: str, depth: int) -> list[float]:
        """[q_1, q_1 q_2, ..., q_1 ... q_depth]: what a node of count ratios 1 at each depth is expected to gain."""
        q = self.calibration(source)
        return list(np.cumprod([q[min(d, len(q)) - 1] for d in range(1, depth + 1)]))

    def observe(self, sources: dict[str, dict[str, int]]) -> None:
        """A finished step's per-source counts (StepStats.sources: proposed, accepted)."""
        for name, row in sources.items():
            self.proposed[name] = self.proposed.get(name, 0) + row.get("proposed", 0)
            self.accepted[name] = self.accepted.get(name, 0) + row.get("accepted", 0)

    def extra_seconds(self, nodes: int, rows: int) -> float:
        """What `rows` more rows add to the verification of a tree of `nodes` drafted nodes: t(1+N+m) - t(1+N)."""
        return float(self.costs.verify(1 + nodes + rows)) - float(self.costs.verify(1 + nodes))

    def pays(self, source: str, rows: int, nodes: int, expected: float, seconds: float) -> bool:
        """Whether `rows` more rows from `source` raise expected / seconds of a tree of `nodes` drafted nodes."""
        if rows == 0 or self.proposed.get(source, 0) < WARMUP:
            return True
        extra = self.extra_seconds(nodes, rows)
        return (expected + rows * self.acceptance(source)) * seconds > expected * (seconds + extra)

    def best_prefix(self, source: str, trial: TokenTree, first: int, scores: dict[int, float],
                    expected: float, seconds: float) -> tuple[int, float]:
        """(m, gain): the number of new nodes of `trial` (from `first` on) whose prefix gives the highest expected
        rate, 0 when no prefix beats the tree without them, and those nodes' expected accepted tokens."""
        reach = self.reach(source, max(trial.depths[first:]))
        best, best_gain, best_rate = 0, 0.0, expected / seconds
        gain = 0.0
        for m, node in enumerate(range(first, len(trial)), 1):
            gain += scores.get(node, 0.0) * reach[trial.depths[node] - 1]
            rate = (expected + gain) / (seconds + self.extra_seconds(first - 1, m))
            if rate > best_rate:
                best, best_gain, best_rate = m, gain, rate
        return best, best_gain

    def settle(self, committed: list[int]) -> None:
        """After a step that committed `committed` (accepted tokens, then the bonus): judge each waiting branch
        whose nodes the tokens committed since its step decide (see the module docstring)."""
        self.committed += committed
        self._steps += 1
        waiting = []
        for g in self._pending:
            known = len(self.committed) - g.start
            on, left = _walk(g.trial, g.kids, self.committed[g.start:])
            final = left or known >= max(g.trial.depths[g.first:]) or self._steps - g.step >= PATIENCE
            self._calibrate(g, on, known, final)
            if final:
                unverified = [i for i in range(g.first + g.kept, len(g.trial)) if g.trial.sources[i] == g.source]
                if unverified:
                    hits = sum(i in on for i in unverified)
                    self.observe({g.source: {"proposed": len(unverified), "accepted": hits}})
            else:
                waiting.append(g)
        self._pending = waiting

    def _calibrate(self, g: _Graft, on: set[int], known: int, final: bool) -> None:
        """Put each scored node that the `known` committed tokens decide (all of them when `final`) in its depth's
        conditional acceptance, if its parent is on the committed walk `on` (or is the root)."""
        table = self.by_depth.setdefault(g.source, [])
        for node, score in g.scores.items():
            if node in g.judged or not (final or g.trial.depths[node] <= known):
                continue
            g.judged.add(node)
            parent = g.trial.parents[node]
            if parent != 0 and parent not in on:
                continue  # below a rejected node: it never had a chance
            d = g.trial.depths[node]
            table.extend([0.0, 0.0] for _ in range(d + 1 - len(table)))
            table[d][0] += score / g.scores.get(parent, 1.0)  # its count ratio r
            table[d][1] += node in on

    def describe(self) -> dict:
        """The account for GenerationStats.policy: each source's measured acceptance, branches left out, and for a
        scored source its calibration at depths 1, 2, ... (8 at most)."""
        out = {}
        for name, n in self.proposed.items():
            if name == "draft":
                continue
            out[name] = {"proposed": n, "accepted": self.accepted.get(name, 0),
                         "acceptance": round(self.acceptance(name), 4), "dropped": self.dropped.get(name, 0)}
            if name in self.by_depth:
                out[name]["by_depth"] = [round(float(c), 3) for c in self.calibration(name)[:8]]
        return out

    def graft(self, tree: TokenTree, source: str, add: Callable[[TokenTree], object], estimate: list[float] | None,
              scores: dict[int, float] | None = None) -> tuple[TokenTree, bool]:
        """(`tree` with what pays of `add`'s branch, True), or (`tree`, False) when none of it pays. `add` grafts
        onto the tree it is given; a scored source fills `scores` (node -> empirical path probability) as it adds.
        `estimate` = [expected tokens, predicted seconds] of the tree so far (updated by what is kept), or None when
        the policy has no cost model: then the branch is always grafted whole, onto `tree` itself."""
        if estimate is None or self.costs is None:
            add(tree)
            return tree, True
        scores = {} if scores is None else scores
        trial = tree.select(list(range(len(tree))))  # a copy: the draft distributions are shared, not copied
        add(trial)
        first, new = len(tree), len(trial) - len(tree)
        if scores:
            kept, gain = self.best_prefix(source, trial, first, scores, *estimate)
        elif self.pays(source, new, first - 1, *estimate):  # (kept whole before WARMUP nodes: pays says so)
            kept, gain = new, new * self.acceptance(source)
        else:
            kept, gain = 0, 0.0
        if scores or kept < new:  # something to judge later: scored nodes, or nodes that were not verified
            self._pending.append(_Graft(source, trial, first, kept, len(self.committed), self._steps, scores))
        if kept == 0 and new:
            self.dropped[source] = self.dropped.get(source, 0) + 1
            return tree, False
        if kept:
            estimate[0] += gain
            estimate[1] += self.extra_seconds(first - 1, kept)
        return (trial if kept == new else _cut(tree, trial, first + kept)), True


def _cut(tree: TokenTree, trial: TokenTree, end: int) -> TokenTree:
    """`trial` (= `tree` + a branch) cut to its first `end` nodes. A node left with none of the branch's children
    gets back the drawing rule it had in `tree`: grafting marked it DETERMINISTIC, which no longer says how its
    children were drawn (a stale mark would not lose exactness, only make the tree look less drawn than it is)."""
    out = trial.select(list(range(end)))
    parents_of_new = {out.parents[i] for i in range(len(tree), end)}
    for node in range(end):
        if node in parents_of_new:
            continue
        if node < len(tree) and node in tree.child_rule:
            out.child_rule[node] = tree.child_rule[node]
        else:
            out.child_rule.pop(node, None)
    return out


def _walk(tree: TokenTree, kids: list[list[int]], tokens: list[int]) -> tuple[set[int], bool]:
    """The nodes reached by following `tokens` from the root (`kids`: the tree's children lists), and whether that
    decides every node: the walk left the tree (a token no child carries) or ended on a leaf."""
    node, on = 0, set()
    for tok in tokens:
        node = child_with_token(tree, kids[node], tok)
        if node is None:
            return on, True
        on.add(node)
    return on, not kids[node]
