"""One budget for the draft-free sources: a grafted branch is kept only when its rows pay under the measured costs.

n-gram, suffix and lookahead branches (ngram.py, suffix.py, lookahead.py) cost no draft call, but every node they add
is one more row in the target's verification forward, and on a CPU rows are not free (t(n) grows with n). Grafting
them blindly can make a method slower than itself without them. So, per step, each source's branch is grafted onto a
trial copy of the drafted tree and kept only if it raises the step's expected rate:

    (E + m * a_s) / (T - t(1 + N) + t(1 + N + m))  >  E / T

where E and T are the policy's expected tokens and predicted seconds for the tree so far (the auto policy's objective:
auto/objective.py), N its drafted nodes, m the rows the branch adds, t the measured verification curve, and a_s the
source's acceptance per proposed node, learned online within the request (accepted / proposed, credited as tree.py
credits nodes, with one accepted and one rejected node as the prior, so a source starts at 0.5). Sources are tried in
the engine's order and E, T grow with each branch kept, so later sources must beat the tree as it stands.

A source that has proposed fewer than `WARMUP` nodes is kept regardless: its acceptance must be measured before it
can be judged. A branch left out still teaches: once as many tokens have been committed after its step as it is
deep (or `PATIENCE` steps have passed), its nodes are matched against them from the root on, and those on the
matching path count as accepted: what verification would have accepted at T = 0, since the committed tokens are the
target's own. So a source that starts to fit the text comes back, even while steps commit one token each. Policies
without measured costs (every policy but auto) keep every branch, as asked.
"""
from __future__ import annotations

from collections.abc import Callable

from ..tree import TokenTree
from ..verify.base import child_with_token

WARMUP = 16  # nodes a source proposes before its measured acceptance decides
PATIENCE = 16  # steps a left-out branch waits for the tokens that judge it


class GraftBudget:
    """Per request: each draft-free source's measured acceptance, and the keep-or-drop decision for its branches."""

    def __init__(self, costs=None):
        self.costs = costs  # the policy's CostModel (verify(n): seconds of a forward over n tree tokens), or None
        self.proposed: dict[str, int] = {}
        self.accepted: dict[str, int] = {}
        self.dropped: dict[str, int] = {}  # branches left out, for the account
        self.committed: list[int] = []  # every token committed in this generation, in order
        # branches left out, waiting to be judged: (source, trial tree, its first new node, len(committed) at its step,
        # the step it was left out at)
        self._left_out: list[tuple[str, TokenTree, int, int, int]] = []
        self._steps = 0

    def acceptance(self, source: str) -> float:
        return (self.accepted.get(source, 0) + 1) / (self.proposed.get(source, 0) + 2)

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

    def settle(self, committed: list[int]) -> None:
        """After a step that committed `committed` (accepted tokens, then the bonus): judge each left-out branch whose
        tokens are all known by now (see the module docstring)."""
        self.committed += committed
        self._steps += 1
        waiting = []
        for entry in self._left_out:
            source, trial, first, start, step = entry
            after = self.committed[start:]
            if len(after) < max(trial.depths[first:]) and self._steps - step < PATIENCE:
                waiting.append(entry)
                continue
            kids = trial.children_lists()
            node, hits = 0, 0
            for tok in after:
                node = child_with_token(trial, kids[node], tok)
                if node is None:
                    break
                hits += node >= first and trial.sources[node] == source
            mine = sum(1 for i in range(first, len(trial)) if trial.sources[i] == source)
            self.observe({source: {"proposed": mine, "accepted": hits}})
        self._left_out = waiting

    def describe(self) -> dict:
        """The account for GenerationStats.policy: each source's measured acceptance and branches left out."""
        return {name: {"proposed": n, "accepted": self.accepted.get(name, 0),
                       "acceptance": round(self.acceptance(name), 4), "dropped": self.dropped.get(name, 0)}
                for name, n in self.proposed.items() if name != "draft"}

    def graft(self, tree: TokenTree, source: str, add: Callable[[TokenTree], object],
              estimate: list[float] | None) -> tuple[TokenTree, bool]:
        """(`tree` with `add`'s branch, True) if it pays (add grafts onto the tree it is given), else (`tree`, False).
        `estimate` = [expected tokens, predicted seconds] of the tree so far (updated when the branch is kept), or
        None when the policy has no cost model: then the branch is always grafted, onto `tree` itself."""
        if estimate is None or self.costs is None:
            add(tree)
            return tree, True
        trial = tree.select(list(range(len(tree))))  # a copy: the draft distributions are shared, not copied
        add(trial)
        rows = len(trial) - len(tree)
        if not self.pays(source, rows, len(tree) - 1, *estimate):
            self.dropped[source] = self.dropped.get(source, 0) + 1
            self._left_out.append((source, trial, len(tree), len(self.committed), self._steps))
            return tree, False
        if rows:
            estimate[0] += rows * self.acceptance(source)
            estimate[1] += self.extra_seconds(len(tree) - 1, rows)
        return trial, True
