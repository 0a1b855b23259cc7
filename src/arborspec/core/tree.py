"""The token tree: what a drafting policy proposes and a verifier checks.

Node 0 is the *root*: the last committed token, whose KV is not yet in the target's cache. Every other node is a
drafted token. Nodes are stored parents-first (a node's index is always larger than its parent's), which every
packing order keeps, so one forward pass can process the nodes in storage order.

For exact verification a tree must remember, per expanded node, the draft distribution its children were drawn from
and *how* they were drawn (see `DrawRule`): multi-branch rejection is exact only for children drawn without
replacement, SpecInfer's multi-step speculative sampling only for children drawn with replacement, and target sampling
(draw from the target, follow the child carrying that token) for any tree, deterministic children included.

Every drafted node also records its *source*, who proposed it: the draft model (`"draft"`, what every policy's `add`
means unless it says otherwise) or a draft-free source grafted onto the tree (suffix statistics, prompt-lookup
n-grams, lookahead's n-gram pool). A node two sources propose is one node (the graft reuses the child carrying the
same token), credited to the *first* source that proposed it; the later ones are kept in `also`. Crediting the first
makes the per-source accepted counts of a step add up to its accepted tokens, and `also` still says how much of a
source's yield another source would have supplied anyway (what mixing sources buys over the best single one).
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch

# The sources the engine grafts from, in the order it grafts them (reports and plots list them in this order; a new
# source is any other string, shown after these).
SOURCES = ("draft", "ngram", "suffix", "lookahead")
# The most nodes a step's drafted tree may hold below its root: every policy refuses options that would draft more
# (a TokenTree itself may be longer: the agreement measurement runs a whole reference text as one chain). Far past
# what pays on a CPU: the 1.5B target's t(128) is 34 t(1) (Zen 4), and one draft call over a 1024-node layer returns
# 0.6 GB of Qwen2.5 logits. Before this bound, `static(depth=100,branch=100)` or a server request for
# `dyspec@100000` grew until memory ran out.
MAX_TREE_NODES = 1024


class DrawRule(str, enum.Enum):
    """How the children of one node were drawn from that node's draft distribution."""

    WITH_REPLACEMENT = "with_replacement"  # i.i.d. samples (SpecInfer); duplicate tokens are allowed
    WITHOUT_REPLACEMENT = "without_replacement"  # sequential sampling, drawn tokens removed (DySpec, Sequoia)
    DETERMINISTIC = "deterministic"  # a function of the draft distribution: top-k, beams, argmax
    # Greedy multi-draft (Hu et al., ICLR 2025): every child but the last is chosen deterministically (the k-1 most
    # probable draft tokens), the last is one sample from the draft restricted to the other tokens, norm(q * 1[not
    # among the earlier children]). The recorded distribution is q itself; storage order is drawing order.
    GREEDY_TOPK_PLUS_ONE = "greedy_topk_plus_one"


@dataclass
class TokenTree:
    """A drafted tree of tokens rooted at the last committed token."""

    tokens: list[int]
    parents: list[int] = field(default_factory=lambda: [-1])
    depths: list[int] = field(default_factory=lambda: [0])
    probs: list[float] = field(default_factory=lambda: [1.0])  # draft prob of the token given its parent's path
    child_dist: dict[int, torch.Tensor] = field(default_factory=dict)  # node -> (vocab,) draft dist of its children
    child_rule: dict[int, DrawRule] = field(default_factory=dict)  # node -> how its children were drawn
    # A DETERMINISTIC node may lack a child_dist (e.g. n-gram branches chosen without any draft model).
    sources: list[str] = field(default_factory=lambda: [""])  # who proposed each node (module docstring); root: ""
    also: dict[int, list[str]] = field(default_factory=dict)  # node -> later sources that proposed it again

    @classmethod
    def root(cls, token: int) -> "TokenTree":
        return cls(tokens=[int(token)])

    @classmethod
    def from_parents(cls, tokens: list[int], parents: list[int]) -> "TokenTree":
        """A tree with given structure and no draft distributions (tests, static shapes)."""
        tree = cls.root(tokens[0])
        for tok, par in zip(tokens[1:], parents[1:]):
            tree.add(par, tok)
        return tree

    # ---- building -------------------------------------------------------------------------------------------
    def add(self, parent: int, token: int, prob: float = 1.0, source: str = "draft") -> int:
        """Append a child of `parent` proposed by `source`; returns the new node's index."""
        if not 0 <= parent < len(self.tokens):
            raise IndexError(f"parent {parent} is not a node of this tree (size {len(self.tokens)})")
        self.tokens.append(int(token))
        self.parents.append(parent)
        self.depths.append(self.depths[parent] + 1)
        self.probs.append(float(prob))
        self.sources.append(source)
        return len(self.tokens) - 1

    def propose_again(self, node: int, source: str) -> None:
        """Record that `source` proposed `node` too (after the source it is credited to)."""
        if node > 0 and source != self.sources[node] and source not in self.also.get(node, ()):
            self.also.setdefault(node, []).append(source)

    def set_children_dist(self, node: int, dist: torch.Tensor, rule: DrawRule) -> None:
        """Record the draft distribution `dist` (vocab,) that node's children were (or will be) drawn from."""
        self.child_dist[node] = dist
        self.child_rule[node] = DrawRule(rule)

    # ---- queries --------------------------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def depth(self) -> int:
        return max(self.depths)

    def children(self, node: int) -> list[int]:
        return [i for i in range(node + 1, len(self.tokens)) if self.parents[i] == node]

    def children_lists(self) -> list[list[int]]:
        kids: list[list[int]] = [[] for _ in self.tokens]
        for i, p in enumerate(self.parents):
            if p >= 0:
                kids[p].append(i)
        return kids

    def path(self, node: int) -> list[int]:
        """Node indices from the root down to `node`, both included."""
        out = []
        while node >= 0:
            out.append(node)
            if len(out) > len(self.parents):  # (a tree built with add() has none; one built by hand may)
                raise ValueError(f"the tree's parents form a cycle through node {node}")
            node = self.parents[node]
        return out[::-1]

    def path_prob(self, node: int) -> float:
        """Product of draft probabilities along the path to `node` (the root counts 1)."""
        p = 1.0
        for i in self.path(node)[1:]:
            p *= self.probs[i]
        return p

    def by_source(self, path: list[int]) -> dict[str, dict[str, int]]:
        """Per source, for a step whose accepted nodes are `path`: `proposed` (nodes credited to it), `accepted`
        (accepted nodes credited to it; these add up to len(path)) and `also_accepted` (accepted nodes it proposed
        too, credited to an earlier source). Sources appear in the order they first proposed a node."""
        out: dict[str, dict[str, int]] = {}
        accepted = set(path)

        def row(source: str) -> dict[str, int]:
            return out.setdefault(source, {"proposed": 0, "accepted": 0, "also_accepted": 0})

        for node in range(1, len(self.tokens)):
            rec = row(self.sources[node])
            rec["proposed"] += 1
            rec["accepted"] += node in accepted
        for node, others in self.also.items():
            for source in others:
                row(source)["also_accepted"] += node in accepted
        return out

    def widths(self) -> list[int]:
        """Number of nodes at each depth, root layer included."""
        out = [0] * (self.depth + 1)
        for d in self.depths:
            out[d] += 1
        return out

    def ancestor_mask(self) -> torch.Tensor:
        """(n, n) bool: mask[i, j] is True iff node j is node i or one of its ancestors."""
        n = len(self.tokens)
        mask = torch.zeros(n, n, dtype=torch.bool)
        for i, p in enumerate(self.parents):
            if p >= 0:
                mask[i] = mask[p]
            mask[i, i] = True
        return mask

    def position_ids(self, root_position: int) -> torch.Tensor:
        """(n,) absolute positions: the root sits at `root_position`, a node at depth d at root_position + d."""
        return torch.tensor(self.depths, dtype=torch.long) + root_position

    def validate(self) -> None:
        """Check the storage invariants (parents first, consistent depths, rules only on expanded nodes)."""
        if self.parents[0] != -1 or self.depths[0] != 0:
            raise ValueError("node 0 must be the root")
        for i in range(1, len(self.tokens)):
            p = self.parents[i]
            if not 0 <= p < i:
                raise ValueError(f"node {i} has parent {p}; parents must come before children")
            if self.depths[i] != self.depths[p] + 1:
                raise ValueError(f"node {i} has depth {self.depths[i]}, parent depth {self.depths[p]}")
        for node, rule in self.child_rule.items():
            if node not in self.child_dist and rule != DrawRule.DETERMINISTIC:
                raise ValueError(f"node {node}'s children were sampled but no distribution is recorded")

    # ---- reshaping ------------------------------------------------------------------------------------------
    def permute(self, order: list[int]) -> "TokenTree":
        """The same tree with nodes stored in `order` (which must list parents before children)."""
        if sorted(order) != list(range(len(self.tokens))) or order[0] != 0:
            raise ValueError("order must be a permutation of the nodes starting with the root")
        return self.select(order)

    def subtree(self, keep: list[int]) -> "TokenTree":
        """The tree restricted to `keep` (must be closed under taking parents), in storage order."""
        keep_set = set(keep) | {0}
        for i in keep_set:
            if i != 0 and self.parents[i] not in keep_set:
                raise ValueError(f"node {i} is kept but its parent {self.parents[i]} is not")
        return self.select(sorted(keep_set))

    def select(self, kept: list[int]) -> "TokenTree":
        """The tree of nodes `kept`, renumbered in that order (new node i is our node kept[i]); `kept` starts with
        the root and lists every kept node's parent before it."""
        if not kept or kept[0] != 0:
            raise ValueError("kept nodes must start with the root")
        new_index = {old: new for new, old in enumerate(kept)}
        out = TokenTree.root(self.tokens[0])
        for old in kept[1:]:
            parent = new_index.get(self.parents[old])
            if parent is None or parent >= len(out):
                raise ValueError(f"node {old} is listed before (or without) its parent {self.parents[old]}")
            out.add(parent, self.tokens[old], self.probs[old], self.sources[old])
            if old in self.also:
                out.also[len(out) - 1] = list(self.also[old])
        self._copy_rules(out, new_index)
        return out

    def _copy_rules(self, out: "TokenTree", new_index: dict[int, int]) -> None:
        """Carry drawing rules and distributions over to `out`, whose node `new_index[i]` is our node i."""
        for old, rule in self.child_rule.items():
            if old in new_index:
                out.child_rule[new_index[old]] = rule
                if old in self.child_dist:
                    out.child_dist[new_index[old]] = self.child_dist[old]


# ---- packing orders -----------------------------------------------------------------------------------------
def bfs_order(tree: TokenTree) -> list[int]:
    """Layer by layer, each layer in storage order."""
    return sorted(range(len(tree)), key=lambda i: (tree.depths[i], i))


def dfs_order(tree: TokenTree) -> list[int]:
    """Pre-order depth-first walk, children in storage order (DySpec App. C)."""
    kids = tree.children_lists()
    out, stack = [], [0]
    while stack:
        node = stack.pop()
        out.append(node)
        stack.extend(reversed(kids[node]))
    return out


def heavy_path_order(tree: TokenTree) -> list[int]:
    """Depth-first, visiting the child with the largest subtree first (heavy-light order, DySpec App. C)."""
    kids = tree.children_lists()
    size = [1] * len(tree)
    for i in range(len(tree) - 1, 0, -1):
        size[tree.parents[i]] += size[i]
    out, stack = [], [0]
    while stack:
        node = stack.pop()
        out.append(node)
        stack.extend(sorted(kids[node], key=lambda c: (size[c], -c)))  # largest (then earliest) popped first
    return out


ORDERS = {"bfs": bfs_order, "dfs": dfs_order, "heavy": heavy_path_order}


def packed(tree: TokenTree, order: str) -> TokenTree:
    """The tree re-stored in the named packing order ('bfs', 'dfs' or 'heavy')."""
    if order not in ORDERS:
        raise ValueError(f"unknown token order {order!r}; choose one of {sorted(ORDERS)}")
    return tree.permute(ORDERS[order](tree))


def block_count(tree: TokenTree, prefix_len: int, block: int = 32) -> int:
    """Non-zero block x block tiles of the attention mask of this tree over a committed prefix.

    The mask has one row per tree node and prefix_len + len(tree) columns: every node sees the whole prefix and its
    own ancestors. Block-sparse attention kernels skip all-zero tiles, so fewer tiles means less work (DySpec App. C).
    """
    n = len(tree)
    mask = torch.cat([torch.ones(n, prefix_len, dtype=torch.bool), tree.ancestor_mask()], dim=1)
    rows = -(-n // block) * block
    cols = -(-(prefix_len + n) // block) * block
    padded = torch.zeros(rows, cols, dtype=torch.bool)
    padded[:n, : prefix_len + n] = mask
    tiles = padded.view(rows // block, block, cols // block, block).any(dim=3).any(dim=1)
    return int(tiles.sum())
