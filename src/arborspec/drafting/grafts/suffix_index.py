"""Suffix statistics over token ids: what followed the current suffix before, and how often (SuffixDecoding's index).

SuffixDecoding (Oliaro et al., arXiv 2411.04975) drafts without a draft model: it finds the longest suffix of the
text that occurred before and proposes the continuations that followed it then, most frequent first. This module
holds the structure that answers those questions; `suffix.py` turns the answers into token trees.

The structure is a *bounded-depth suffix trie with counts* (`CountTrie`): one node per distinct substring of length
<= `depth` of the indexed sequences, with
    count[v] = occurrences of v's string,   cont[v] = those followed by one more token = sum of v's children's counts.
So count[child] / cont[v] is the empirical probability of the child's token after v's string, and a product of these
ratios down a path is the empirical probability of that whole continuation.

Costs (n tokens indexed, D = depth, which is max_match + max_depth):
- appending a token: O(D) -- the sequence keeps the nodes of its last D suffixes ("open" nodes), and each of them
  gets one child counted; the context is never rescanned;
- finding the longest suffix that occurred before: O(max_match^2) dictionary look-ups, independent of n;
- a speculation tree of B nodes: O(B * (B + log B)) (best-first over the children of the matched node);
- memory: at most n * D nodes (far fewer on repetitive text, where substrings are shared).
A suffix tree or automaton would have O(1) appends and O(n) memory but needs suffix links and occurrence counts
propagated along them; the trie buys plain counts and simple deletion (which the store's eviction needs) for a
constant factor D.

Two scopes, merged at query time as if they were one trie (counts of the same string add up):
- the current request: prompt + tokens generated so far, one sequence (`SuffixIndex.follow`);
- `OutputStore`: earlier requests' outputs, each its own sequence (substrings never cross two outputs), bounded in
  tokens, evicting whole outputs oldest first.
"""
from __future__ import annotations

import heapq
import itertools
import math
from collections import deque
from dataclasses import dataclass


class CountTrie:
    """Counts of every substring of length <= `depth` of the sequences added to it."""

    def __init__(self, depth: int):
        if depth < 1:
            raise ValueError(f"a suffix trie needs depth >= 1, got {depth}")
        self.depth = depth
        self.kids: list[dict[int, int] | None] = [None]  # node -> {token: child node}; node 0 is the empty string
        self.count: list[int] = [0]
        self.cont: list[int] = [0]
        self.free: list[int] = []  # ids of deleted nodes, reused first

    def __len__(self) -> int:
        """Live nodes, the root included."""
        return len(self.count) - len(self.free)

    # ---- adding and removing sequences ----------------------------------------------------------------------
    def start(self) -> list[int]:
        """The open nodes of an empty sequence: only the empty suffix (the root)."""
        return [0]

    def append(self, open_nodes: list[int], token: int) -> list[int]:
        """Count one more token of a sequence whose suffixes of length 0, 1, ... are `open_nodes`; returns the
        sequence's new open nodes (its suffixes of length 0 .. depth - 1)."""
        self.count[0] += 1
        out = [0]
        for node in open_nodes:  # node = a suffix of length L; its child = the suffix of length L + 1 now
            child = self._child(node, token)
            self.count[child] += 1
            self.cont[node] += 1
            out.append(child)
        del out[self.depth:]  # a suffix of length `depth` is counted but never extended
        return out

    def add(self, tokens: list[int]) -> None:
        """Count a whole sequence."""
        open_nodes = self.start()
        for tok in tokens:
            open_nodes = self.append(open_nodes, tok)

    def remove(self, tokens: list[int]) -> None:
        """Undo `add(tokens)` for a sequence that was added; nodes whose count drops to zero are deleted."""
        self.count[0] -= len(tokens)
        open_nodes, dead = [0], []
        for tok in tokens:
            out = [0]
            for node in open_nodes:
                child = self.kids[node][tok]
                self.count[child] -= 1
                self.cont[node] -= 1
                if self.count[child] == 0:
                    dead.append((node, tok, child))
                out.append(child)
            open_nodes = out[: self.depth]
        # deleted only now: a dead node may still be open while the rest of the sequence is walked
        dead_ids = {child for _, _, child in dead}
        for parent, tok, child in dead:
            if parent not in dead_ids:
                del self.kids[parent][tok]
        for child in dead_ids:
            self.kids[child], self.cont[child] = None, 0
            self.free.append(child)

    def _child(self, node: int, token: int) -> int:
        kids = self.kids[node]
        if kids is None:
            kids = self.kids[node] = {}
        child = kids.get(token)
        if child is None:
            if self.free:
                child = self.free.pop()
            else:
                child = len(self.count)
                self.kids.append(None)
                self.count.append(0)
                self.cont.append(0)
            kids[token] = child
        return child

    # ---- queries --------------------------------------------------------------------------------------------
    def find(self, tokens) -> int | None:
        """The node of the string `tokens`, or None if it never occurred."""
        node = 0
        for tok in tokens:
            node = self.child(node, tok)
            if node is None:
                return None
        return node

    def child(self, node: int | None, token: int) -> int | None:
        """The node of node's string followed by `token` (None if that never occurred)."""
        kids = self.kids[node] if node is not None else None
        return kids.get(token) if kids else None

    def children(self, node: int | None) -> dict[int, int]:
        """{token: count of node's string followed by that token}."""
        kids = self.kids[node] if node is not None else None
        return {tok: self.count[child] for tok, child in kids.items()} if kids else {}


class OutputStore:
    """Earlier requests' outputs, at most `capacity` tokens in all, evicted whole, oldest first (FIFO).

    An output longer than the whole store keeps only its last `capacity` tokens."""

    def __init__(self, depth: int, capacity: int):
        if capacity < 0:
            raise ValueError(f"the store's capacity must be >= 0 tokens, got {capacity}")
        self.trie, self.capacity = CountTrie(depth), capacity
        self.outputs: deque[list[int]] = deque()
        self.tokens = 0  # tokens held, always <= capacity

    def add(self, output: list[int]) -> None:
        output = list(output[max(len(output) - self.capacity, 0):]) if self.capacity else []
        if not output:
            return
        while self.tokens + len(output) > self.capacity:
            old = self.outputs.popleft()
            self.trie.remove(old)
            self.tokens -= len(old)
        self.trie.add(output)
        self.outputs.append(output)
        self.tokens += len(output)


@dataclass
class Continuation:
    """One node of a speculation tree."""

    parent: int  # index of the parent in the speculation's node list; -1 = the root (the context's last token)
    token: int
    prob: float  # empirical P(token | context, the path above it): a count ratio
    path_prob: float  # product of `prob` from the root down to this node


@dataclass
class Speculation:
    match: int  # length of the longest suffix of the context that occurred before with a continuation (0: none)
    nodes: list[Continuation]  # parents before children, most probable first among what the budget allowed


class SuffixIndex:
    """The current request's suffix trie plus the store of earlier outputs; answers speculation queries.

    `max_match`: the longest suffix looked up; `max_depth`: the deepest continuation kept after a suffix of that
    length (the tries hold strings up to max_match + max_depth tokens); `store`: the store's size in tokens (0: none).
    """

    def __init__(self, max_match: int = 16, max_depth: int = 8, store: int = 0):
        for name, value in (("max_match", max_match), ("max_depth", max_depth)):
            if int(value) != value or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if int(store) != store or store < 0:
            raise ValueError(f"store must be an integer >= 0 (tokens), got {store!r}")
        self.max_match, self.max_depth = int(max_match), int(max_depth)
        self.store = OutputStore(self.max_match + self.max_depth, int(store))
        self._new_request()

    def _new_request(self) -> None:
        self.request = CountTrie(self.max_match + self.max_depth)
        self.tokens: list[int] = []  # the current request's tokens, as indexed
        self.prompt_len = 0
        self._open = self.request.start()

    # ---- keeping up with the text ---------------------------------------------------------------------------
    def append(self, token: int) -> None:
        self.tokens.append(int(token))
        self._open = self.request.append(self._open, int(token))

    def extend(self, tokens) -> None:
        for tok in tokens:
            self.append(tok)

    def finish_request(self) -> None:
        """Move the current request's output (what came after its prompt) into the store; start an empty request."""
        self.store.add(self.tokens[self.prompt_len:])
        self._new_request()

    def follow(self, context: list[int]) -> None:
        """Index `context`, the committed tokens: append what is new if it continues the current request, else
        finish the request and index `context` as the next request's prompt.

        Continuity is judged in O(1): `context` must be at least as long as what is indexed and agree with it on the
        first and last few tokens. A misjudged boundary only changes which tokens are proposed, never the output.
        """
        n = len(self.tokens)
        if not self._continues(context):
            if n:
                self.finish_request()
            self.extend(context)
            self.prompt_len = len(context)
            return
        self.extend(context[n:])

    def _continues(self, context: list[int], window: int = 16) -> bool:
        n = len(self.tokens)
        if n == 0 or len(context) < n:
            return False
        head = min(window, n)
        return context[:head] == self.tokens[:head] and context[n - head : n] == self.tokens[n - head :]

    # ---- queries --------------------------------------------------------------------------------------------
    def match(self, min_match: int = 1) -> tuple[int, list[int | None]]:
        """The longest suffix of the request (length min_match .. max_match) that was followed by a token before, in
        the request or the store, and its node in each trie (None where it never occurred); (0, []) if none is."""
        tries = (self.request, self.store.trie)
        for m in range(min(self.max_match, len(self.tokens)), max(min_match, 1) - 1, -1):
            suffix = self.tokens[-m:]
            nodes = [trie.find(suffix) for trie in tries]
            if any(node is not None and trie.cont[node] > 0 for trie, node in zip(tries, nodes)):
                return m, nodes
        return 0, []

    def speculate(self, budget: int, max_depth: int | None = None, min_match: int = 1, factor: float = 0.0,
                  min_prob: float = 0.0) -> Speculation:
        """The `budget` most probable continuations of the longest matched suffix, as a tree (best-first by empirical
        path probability; siblings of equal count in token-id order, other ties first found first, so the answer is
        deterministic).

        `factor` > 0 sizes the tree by the match: at most ceil(factor * match) nodes (SuffixDecoding's adaptive
        speculation length: a long match is a confident one). Nodes below `min_prob` path probability are left out;
        none is deeper than `max_depth` (default: the index's).
        """
        depth = self.max_depth if max_depth is None else min(max_depth, self.max_depth)
        m, nodes = self.match(min_match)
        if m == 0 or budget <= 0 or depth <= 0:
            return Speculation(m, [])
        if factor > 0:
            budget = min(budget, math.ceil(factor * m - 1e-9))
        tries = (self.request, self.store.trie)
        out: list[Continuation] = []
        heap: list = []  # (-path_prob, tie, parent index in `out`, token, prob, depth, the string's node per trie)
        tie = itertools.count()

        def push_children(parent: int, path_prob: float, d: int, at: list[int | None]) -> None:
            if d >= depth:
                return
            for tok, count, total in _best_children(tries, at, budget - len(out)):
                prob = count / total
                if path_prob * prob < min_prob:
                    break  # children come most frequent first
                kids = [trie.child(node, tok) for trie, node in zip(tries, at)]
                heapq.heappush(heap, (-path_prob * prob, next(tie), parent, tok, prob, d + 1, kids))

        push_children(-1, 1.0, 0, nodes)
        while heap and len(out) < budget:  # a child is pushed after its parent is popped: parents come first
            neg, _, parent, tok, prob, d, at = heapq.heappop(heap)
            out.append(Continuation(parent, tok, prob, -neg))
            push_children(len(out) - 1, -neg, d, at)
        return Speculation(m, out)


def _best_children(tries, nodes, k: int) -> list[tuple[int, int, int]]:
    """The k most frequent next tokens after one string, counted over all tries: (token, count, total count)."""
    counts: dict[int, int] = {}
    total = 0
    for trie, node in zip(tries, nodes):
        if node is None:
            continue
        total += trie.cont[node]
        for tok, c in trie.children(node).items():
            counts[tok] = counts.get(tok, 0) + c
    best = heapq.nsmallest(max(k, 0), counts.items(), key=lambda kv: (-kv[1], kv[0]))
    return [(tok, c, total) for tok, c in best]
