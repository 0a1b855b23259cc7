"""DySpec Alg. 2: the threshold variant, one draft call per layer.

Values are those of Alg. 1 (see `dyspec`): a node drawn from a slot of value v with residual R has child-slot value
v * R[y], and its next sibling slot v * (1 - R[y]). Alg. 2 expands, layer by layer, every slot whose value exceeds the
threshold t (the listing's line 9 reads `while v_i < t`; expanding while the value is *above* the threshold,
`while v_i > t`, is what the text means), drawing children without replacement. The paper suggests t ~ 1/n
(default: 1/budget) and relaxes the size; we keep `budget` as a hard cap on the drafted tokens. Within a layer
the slots are popped most valuable first (a per-layer heap), so when the cap bites the budget goes to the best slots;
without the cap the set of slots expanded is exactly the listing's. If t equals the value of Alg. 1's last pop, the
tree is Alg. 1's (App. A.1).
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass

from ..core.options import check_int, opt
from ..core.sampling import sample
from ..core.tree import MAX_TREE_NODES, DrawRule, TokenTree
from .base import DraftContext, Policy


@dataclass
class DySpecThresholdOptions:
    budget: int = opt(64, "maximum drafted tokens per step (hard cap on the tree size)")
    threshold: float = opt(0.0, "expand every draw whose value exceeds this (0 = 1/budget)")

    def __post_init__(self):
        check_int(self.budget, "budget", high=MAX_TREE_NODES)
        if not 0 <= float(self.threshold) < 1:
            raise ValueError(f"threshold must be in [0, 1), got {self.threshold!r}")
        self.threshold = float(self.threshold) or 1.0 / self.budget


class DySpecThresholdPolicy(Policy):
    name = "dyspec-threshold"
    summary = "DySpec Alg. 2: expand, layer by layer, every draw whose value exceeds --threshold (cap --budget)"
    Options = DySpecThresholdOptions
    sampled_rule = DrawRule.WITHOUT_REPLACEMENT  # verified exactly by mbr

    @property
    def max_tree_depth(self) -> int:
        return self.options.budget

    def draft(self, ctx: DraftContext) -> TokenTree:
        budget, t = self.options.budget, self.options.threshold
        greedy = ctx.sampling.greedy
        tree = TokenTree.root(ctx.context[-1])
        frontier = [(1.0, 0)]  # (value of the node's first child slot, node)
        depth = 0
        while frontier and len(tree) - 1 < budget and depth < ctx.max_depth:
            left = budget - (len(tree) - 1)
            # each expanded node takes >= 1 of the `left` tokens, so only the `left` best can be expanded
            frontier = sorted((vn for vn in frontier if vn[0] > t), key=lambda vn: (-vn[0], vn[1]))[:left]
            if not frontier:
                break
            nodes = [n for _, n in frontier]
            logits = ctx.session.forward(ctx.context, tree, nodes)
            warped = ctx.sampling.probs(logits)
            plain = logits.float().softmax(dim=-1)
            residual = {n: (plain[i] if greedy else warped[i]).double() for i, n in enumerate(nodes)}
            row = {n: i for i, n in enumerate(nodes)}
            heap = [(-v, i, n) for i, (v, n) in enumerate(frontier)]
            heapq.heapify(heap)
            seq = len(heap)
            new = []
            while heap and len(tree) - 1 < budget:
                neg, _, node = heapq.heappop(heap)
                v = -neg
                if v <= t:
                    break  # the heap's best is below the threshold, so is everything else
                R = residual[node]
                y = int(R.argmax()) if greedy else sample(R, ctx.generator)[0]
                r = float(R[y])
                if node not in tree.child_rule:
                    rule = DrawRule.DETERMINISTIC if greedy else DrawRule.WITHOUT_REPLACEMENT
                    tree.set_children_dist(node, warped[row[node]], rule)
                prob = float(plain[row[node], y]) if greedy else float(warped[row[node], y])
                child = tree.add(node, y, prob)
                new.append((v * r, child))
                rest = R.clone()
                rest[y] = 0.0
                mass = float(rest.sum())
                if mass > 0:
                    residual[node] = rest / mass
                    heapq.heappush(heap, (-v * (1 - r), seq, node))
                    seq += 1
            frontier = new
            depth += 1
        return tree
