"""One step's tree: grown one draft call (one layer) at a time while the next layer raises the objective.

Scores (DySpec's node values). At temperature 0 a node's score is its path probability under the draft,
x_u = product of draft probabilities along its path (DySpec Fig. 2: draft probability approximates acceptance), and
the children of u are its top draft tokens. At temperature > 0 children are drawn one at a time without replacement
(verified exactly by traversal, auto's default, or multi-branch rejection, `mbr`); the j-th draw under u comes from
the residual R_j (the draft's q with the earlier draws removed) and its score is its *expected* path probability
x_u * sum_y R_j(y) q(y), known before the token is drawn; the drawn child's own path probability x_u * q(y_j)
scores its children. A node's expected accepted tokens (its gain) is a(score), the calibrated acceptance
(acceptance.py).

Growing the tree, one draft call per layer; F = the newest layer (the frontier), best score first:

1. Whether to call the draft (before the call, `plan_forward`). Children are predicted as x_u * c_j, with c_j a
   running mean, over the root's rows, of the draft's j-th largest probability (T = 0) or of the j-th draw's
   expected probability (T > 0).
   For f in 1, 2, 3, 4, 5, 6, 8, ..., 64 (f <= |F|):

       R_pred(f) = max_m (E + [m best predicted gains among the children of the f best frontier nodes])
                         / (D + d(f) + t(1 + N + m) + c)

   with D the draft time spent so far. The f* best frontier nodes are forwarded iff max_f R_pred(f) > R(S);
   otherwise the tree is final.
2. Which children to add (after the call, `objective.best_prefix`): with the real candidates' gains
   g_1 >= g_2 >= ..., add the m* best, m* = argmax_m (E + g_1 + ... + g_m) / (D + t(1 + N + m) + c), D now including
   the call just made. m* = 0 ends the tree (that call was wasted: `wasted` in the per-step stats). At T > 0 the
   candidates are drawn one at a time and the test runs before each draw over the slots already known, so whether a
   child exists never depends on its own token (this is what keeps mbr and traversal exact).

Exactness: a tree depends only on the draft's outputs for this step, on draws from the step's generator, and on
the past (calibration, timings, guard state), never on the target's verdict for the step being drafted. Timing
makes trees vary from run to run, so sampled outputs with a fixed seed can differ between runs (each one exact).
"""
from __future__ import annotations

import heapq

import numpy as np
import torch

from ...core.sampling import draw_new
from ...core.tree import DrawRule, TokenTree
from ..base import DraftContext
from .acceptance import Calibrator
from .objective import CostModel, best_prefix
from .options import AutoOptions

MAX_FORWARD = 64  # nodes one draft call may forward
FORWARD_SIZES = (1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 20, 24, 32, 40, 48, 64)  # frontier prefixes tried (bounded work)
# running-mean step of the child-probability predictor, per forwarded row of the root (the rows it predicts whether to
# draft from at all). Why the root's rows only: over every forwarded row, siblings' and the last layer's included
# (the rows where the draft was unsure and the tree stopped), c_1 fell to 0.47-0.66 on the default pair, whose top
# token agrees with the target's 0.906 of the time; the first layer then looked unpaid and auto left the draft unused
# on a Zen 4 host (docs/kernels.md, "A real Zen 4 host"). Deeper layers are judged on the draft's real probabilities.
PREDICTOR_RATE = 0.1


class TreeBuilder:
    """One step's tree: the layer loop of the module docstring."""

    def __init__(self, ctx: DraftContext, costs: CostModel, acceptance: Calibrator, child_probs: np.ndarray,
                 options: AutoOptions, force: bool = False, pending: int = 0):
        self.ctx, self.costs, self.options, self.force = ctx, costs, options, force
        self.acceptance = acceptance  # a(score): expected accepted tokens of a node with that score
        self.child_probs = child_probs  # (max_children,) the predictor c_j, updated in place as the draft is seen
        self.pending = pending  # committed tokens the draft's first call must catch up on (after plain steps)
        self.greedy = ctx.sampling.greedy
        self.tree = TokenTree.root(ctx.context[-1])
        self.path_probs = [1.0]  # per node: x_u, the path probability (the first-child slot value of its children)
        self.scores: list[float] = []  # per drafted node: calibration score
        self.expected = 1.0
        self.draft_time = 0.0  # predicted, scaled
        self.draft_raw = 0.0  # predicted, unscaled profile
        self.forwarded: list[int] = []
        self.stop = ""
        self.wasted = 0

    @property
    def nodes(self) -> int:
        return len(self.tree) - 1

    def seconds(self) -> float:
        return self.draft_time + float(self.costs.verify(1 + self.nodes)) + self.costs.overhead

    def rate(self) -> float:
        return self.expected / self.seconds()

    def run(self) -> TokenTree:
        frontier = [0]
        depth_limit = min(self.options.max_layers, self.ctx.max_depth)
        layer = 0
        while True:
            if layer >= depth_limit:
                self.stop = "max depth"
                break
            if self.nodes >= self.options.max_nodes:
                self.stop = "max nodes"
                break
            forced = self.force and layer == 0
            f = self.plan_forward(frontier)
            if f == 0 and not forced:
                self.stop = "next layer predicted not to pay" if layer else "drafting predicted not to pay"
                break
            fwd = frontier[: max(f, 1)]
            logits = self.ctx.session.forward(self.ctx.context, self.tree, fwd)  # (len(fwd), vocab)
            self.forwarded.append(len(fwd))
            raw = float(self.costs.raw_draft(len(fwd) + (self.pending if layer == 0 else 0)))
            self.draft_raw += raw  # what the call really costs, catch-up included (for the measured/predicted ratio)
            self.draft_time += float(self.costs.layer(len(fwd)))  # the steady-state cost
            warped = self.ctx.sampling.probs(logits)
            plain = logits.float().softmax(dim=-1)
            new = self.select_greedy(fwd, warped, plain, forced) if self.greedy else \
                self.select_sampled(fwd, warped, forced)
            if not new:
                self.wasted += 1
                self.stop = "no child pays"
                break
            frontier = sorted(new, key=lambda n: -self.path_probs[n])
            layer += 1
        return self.tree

    # ---- 1. whether to call the draft -----------------------------------------------------------------------
    def predicted_scores(self, xs: np.ndarray) -> np.ndarray:
        """(len(xs), K) predicted scores of the children of frontier nodes with path probabilities xs: x_u * c_j."""
        return xs[:, None] * self.child_probs[None, :]

    def plan_forward(self, frontier: list[int]) -> int:
        """f*: forward the f* best frontier nodes, or 0 if no f is predicted to raise the rate."""
        room = self.options.max_nodes - self.nodes
        xs = np.asarray([self.path_probs[n] for n in frontier[:MAX_FORWARD]], dtype=np.float64)
        if room <= 0 or len(xs) == 0:
            return 0
        gains = self.acceptance(self.predicted_scores(xs))  # (F, K)
        now = self.rate()
        best_f, best = 0, now
        for f in FORWARD_SIZES:
            if f > len(xs):
                break
            merged = np.sort(gains[:f].ravel())[::-1][:room]
            _, r = best_prefix(self.expected, self.draft_time + float(self.costs.layer(f)), self.nodes, merged,
                               self.costs)
            if r > best * (1 + 1e-9):
                best_f, best = f, r
        return best_f

    # ---- 2. which children to add ---------------------------------------------------------------------------
    def _add(self, parent: int, token: int, prob: float, path_prob: float, score: float, gain: float) -> int:
        child = self.tree.add(parent, token, prob)
        self.path_probs.append(path_prob)
        self.scores.append(score)
        self.expected += gain
        return child

    def select_greedy(self, fwd: list[int], warped: torch.Tensor, plain: torch.Tensor, forced: bool) -> list[int]:
        """Temperature 0: the children of a node are its top draft tokens; add the m* best by calibrated gain."""
        k = min(self.options.max_children, plain.shape[-1])
        top = torch.topk(plain, k, dim=-1)
        probs = top.values.double().numpy()  # (len(fwd), k), each row descending
        c = self.child_probs
        kk = min(k, len(c))
        if fwd[0] == 0:  # the root's row (PREDICTOR_RATE)
            c[:kk] += PREDICTOR_RATE * (probs[0, :kk] - c[:kk])
        xs = np.asarray([self.path_probs[n] for n in fwd])[:, None]
        scores = (xs * probs).ravel()
        gains = self.acceptance(scores)
        order = np.lexsort((np.arange(len(scores)), -scores, -gains))  # best gain first; within a node: rank order
        room = self.options.max_nodes - self.nodes
        m, _ = best_prefix(self.expected, self.draft_time, self.nodes, gains[order], self.costs, max_add=room)
        if forced:
            m = max(m, 1)
        new = []
        for flat in order[:m]:
            i, j = divmod(int(flat), k)
            node = fwd[i]
            if node not in self.tree.child_rule:
                self.tree.set_children_dist(node, warped[i], DrawRule.DETERMINISTIC)
            token = int(top.indices[i, j])
            new.append(self._add(node, token, float(plain[i, token]), float(scores[flat]), float(scores[flat]),
                                 float(gains[flat])))
        return new

    def select_sampled(self, fwd: list[int], warped: torch.Tensor, forced: bool) -> list[int]:
        """Temperature > 0: children drawn one at a time without replacement (DySpec's slots). The j-th draw under u
        comes from the residual R_j (q with the earlier draws removed); its score, the expected path probability
        x_u * sum_y R_j(y) q(y) = x_u * (sum q^2 - sum_{l<j} q(y_l)^2) / (1 - sum_{l<j} q(y_l)), is known before the
        draw, and the marginal test runs over the known slots before each draw."""
        q = warped.double()  # (len(fwd), vocab)
        cdf = torch.cumsum(q, dim=-1)
        total = cdf[:, -1].tolist()
        square = (q * q).sum(dim=-1).tolist()
        row = {n: i for i, n in enumerate(fwd)}
        taken = {n: [] for n in fwd}  # tokens drawn so far under each node
        removed = {n: 0.0 for n in fwd}  # their probability mass
        removed_sq = {n: 0.0 for n in fwd}
        c = self.child_probs
        heap: list[tuple] = []
        seq = 0

        def push(node: int) -> None:
            nonlocal seq
            i, j = row[node], len(taken[node])
            left = total[i] - removed[node]
            expected = max(square[i] - removed_sq[node], 0.0) / left  # E[q(y)], y ~ R_j
            score = self.path_probs[node] * expected
            if j < len(c) and node == 0:  # the root's draws (PREDICTOR_RATE)
                c[j] += PREDICTOR_RATE * (expected - c[j])
            heapq.heappush(heap, (-float(self.acceptance(score)), -score, seq, node, score))
            seq += 1

        for n in fwd:
            push(n)
        new: list[int] = []
        while heap and self.nodes < self.options.max_nodes:
            known = np.sort(np.asarray([-h[0] for h in heap]))[::-1]
            m, _ = best_prefix(self.expected, self.draft_time, self.nodes, known, self.costs,
                               max_add=self.options.max_nodes - self.nodes)
            if m == 0 and not (forced and not new):
                break
            neg_gain, _, _, node, score = heapq.heappop(heap)
            i = row[node]
            y = draw_new(q[i], cdf[i], taken[node], self.ctx.generator)
            if node not in self.tree.child_rule:
                self.tree.set_children_dist(node, warped[i], DrawRule.WITHOUT_REPLACEMENT)
            qy = float(q[i, y])
            taken[node].append(y)
            removed[node] += qy
            removed_sq[node] += qy * qy
            new.append(self._add(node, y, float(warped[i, y]), self.path_probs[node] * qy, score, -neg_gain))
            if total[i] - removed[node] > 1e-9 * total[i] and len(taken[node]) < self.options.max_children:
                push(node)
        return new

