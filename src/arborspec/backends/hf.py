"""Tree attention on HuggingFace causal LMs: one forward over many tree nodes on top of a committed KV cache.

The KV cache of a `TreeSession` is laid out as

    [ committed prefix (len(self.cached)) | speculative region: tree nodes forwarded this step ]

A forward appends nodes to the region; each node attends to the whole committed prefix and to its own ancestors in
the tree, at position (root position + depth). `commit(path)` keeps the prefix plus the KV entries of an accepted
root-to-node path, gathered along the sequence axis, and drops the rest: the accepted tokens are never re-run.

Committed tokens that are not in the cache yet (the prompt at the first step, tokens the draft never forwarded) are
"pending": they ride along as a causal chain in front of the first forward of a step, so catching up costs no
separate pass. transformers (5.x) passes a 4D mask of shape (batch, 1, q_len, kv_len) through to attention unchanged; an
additive float mask (0 or the dtype's minimum) is used because eager attention silently mis-reads a boolean one (it
adds it to the scores: logits off by ~27).
"""
from __future__ import annotations

import inspect

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from ..core.sampling import check_finite
from ..core.tree import TokenTree
from . import batching
from .model_info import context_window
from .session import TreeRegion


class TreeSession(TreeRegion):
    """One sequence's KV cache on one model, with a speculative tree region (implements `session.Session`)."""

    def __init__(self, model, role: str = "target"):
        self.model = model
        self.role = role
        self.cache = DynamicCache(config=model.config)
        self.cached: list[int] = []  # committed token ids whose KV is in the cache
        self.tree: TokenTree | None = None  # the tree the region belongs to
        self.slot: dict[int, int] = {}  # tree node -> offset in the region
        self.region_len = 0  # KV entries in the region (after `renumber`, some belong to no node)
        self.forwards = 0  # model calls, for statistics

    def forward(self, context: list[int], tree: TokenTree, nodes: list[int]) -> torch.Tensor:
        """Logits (len(nodes), vocab) for `nodes` of `tree`, whose root is context[-1].

        Every ancestor of a node must be in the region already or among `nodes` (listed parents first).
        """
        pending = begin_forward(self, context, tree, nodes)
        q = len(pending) + len(nodes)
        past = len(self.cached) + self.region_len
        kv_len = past + q
        allowed = torch.zeros(q, kv_len, dtype=torch.bool)  # (q, kv_len), True = may attend
        for i in range(len(pending)):  # a causal chain over the prefix
            allowed[i, : len(self.cached) + i + 1] = True
        prefix_len = len(self.cached) + len(pending)
        new_slot = {node: self.region_len + j for j, node in enumerate(nodes)}
        for j, node in enumerate(nodes):
            row = len(pending) + j
            allowed[row, :prefix_len] = True
            for anc in tree.path(node):
                slot = self.slot.get(anc, new_slot.get(anc))
                if slot is None:
                    raise RuntimeError(f"node {node}'s ancestor {anc} has not been forwarded")
                allowed[row, prefix_len + slot] = True
        root_pos = len(context) - 1
        positions = [len(self.cached) + i for i in range(len(pending))]
        positions += [root_pos + tree.depths[n] for n in nodes]
        ids = pending + [tree.tokens[n] for n in nodes]
        logits = self._run(ids, positions, allowed, keep=len(nodes))  # (len(nodes), vocab)
        end_forward(self, pending, new_slot)
        return logits

    def prefill(self, ids: list[int]) -> None:
        """Put committed tokens into the cache without computing logits over the vocabulary."""
        if self.region_len:
            raise RuntimeError("prefill with a non-empty region")
        if not ids:  # nothing to put (a forward of no rows failed: its ids made a float tensor)
            return
        n, past = len(ids), len(self.cached)
        allowed = torch.ones(n, past + n, dtype=torch.bool).tril(diagonal=past)
        self._run(list(ids), list(range(past, past + n)), allowed, keep=1)
        self.cached.extend(ids)

    def commit(self, path: list[int]) -> None:
        """Keep the committed prefix plus the region slots of `path` (root first, a chain); drop the rest."""
        check_path(self, path)
        base = len(self.cached)
        keep_slots = [self.slot[n] for n in path]
        if keep_slots != list(range(len(keep_slots))) or len(keep_slots) != self.region_len:
            index = torch.tensor(list(range(base)) + [base + s for s in keep_slots])
            for layer in self.cache.layers:
                layer.keys = layer.keys.index_select(-2, index)
                layer.values = layer.values.index_select(-2, index)
        self.cached.extend(self.tree.tokens[n] for n in path)
        self.slot = {}
        self.region_len = 0
        self.tree = None

    # ---- internals --------------------------------------------------------------------------------------------
    @torch.inference_mode()
    def _run(self, ids: list[int], positions: list[int], allowed: torch.Tensor, keep: int) -> torch.Tensor:
        dtype = self.model.dtype
        mask = torch.zeros(allowed.shape, dtype=dtype).masked_fill_(~allowed, torch.finfo(dtype).min)
        call = dict(
            input_ids=torch.tensor([ids]),
            position_ids=torch.tensor([positions]),
            attention_mask=mask[None, None],  # (1, 1, q, kv_len)
            past_key_values=self.cache,
            use_cache=True,
            # positions as a tensor, not the int `keep`: an int slices hidden_states[:, -keep:] into a strided view,
            # and the bf16 lm_head matmul on that view is ~8x slower on CPU whenever keep < len(ids) (0.5B draft,
            # 17 tokens, keep 1: 600-850 ms vs 70 ms); a tensor gathers a contiguous copy. Same logits.
            logits_to_keep=torch.arange(len(ids) - keep, len(ids)),
        )
        # inside a batching round, the call joins the round's one forward over every request (batching.py)
        out = batching.forward(self.model, call, self.role)
        self.forwards += 1
        logits = out.logits[0].float()  # (keep, vocab)
        check_finite(logits, self.role)
        return logits


def begin_forward(session, context: list[int], tree: TokenTree, nodes: list[int]) -> list[int]:
    """Start a forward of `nodes` on `session` (any backend's session with `tree`, `slot`, `cached` and `role`): check
    the call, bind the tree to the region, and return the committed tokens before the tree's root that the session
    has not processed yet.

    Only the first forward of a step carries such pending tokens; later forwards of the same step (the region is not
    empty) add tree nodes only.
    """
    if not nodes:
        raise ValueError("forward needs at least one node")
    if not all(0 <= n < len(tree.tokens) for n in nodes):
        raise ValueError(f"forward's nodes must be nodes of the tree (0 to {len(tree.tokens) - 1}), got {nodes}")
    if session.tree is not tree:
        if session.slot:
            raise RuntimeError("the region holds another tree's nodes; commit() before starting a new tree")
        session.tree = tree
    if tree.tokens[0] != context[-1]:
        raise ValueError("the tree's root must be the last committed token")
    if session.slot:
        return []
    n = len(session.cached)
    if n >= len(context) or context[:n] != session.cached:
        raise RuntimeError(f"{session.role} cache is out of sync with the committed tokens")
    return context[n:-1]


def check_path(session, path: list[int]) -> None:
    """ValueError unless `path` is what `commit` keeps: the root, then a chain of its descendants, each forwarded this
    step (any backend's session, as for begin_forward). A sibling or a node twice kept keys at the wrong positions,
    and a node never forwarded was a bare KeyError."""
    if path and path[0] != 0 or any(session.tree.parents[b] != a for a, b in zip(path, path[1:])):
        raise ValueError(f"commit path {path} is not a chain of the tree from its root")
    missing = [n for n in path if n not in session.slot]
    if missing:
        raise ValueError(f"commit path nodes {missing} are not in the region (not forwarded, or evicted)")


def end_forward(session, pending: list[int], new_slot: dict[int, int]) -> None:
    """After a forward ran on `session` (any backend's, as for begin_forward): the pending tokens are committed and
    the forwarded nodes hold the region slots `new_slot` gave them."""
    session.cached.extend(pending)
    session.slot.update(new_slot)
    session.region_len += len(new_slot)


def check_tree_attention(model) -> None:
    """Refuse models whose attention would not follow a tree's positions and mask, so that a tree forward would
    silently differ from the model's own decoding (found by running 74 transformers architectures, tiny and random,
    against their own `generate`; ALiBi models and GPT-Neo's local layers ran chains right and trees wrong):
    - a forward without `past_key_values` or `position_ids` (RWKV swallows the cache in **kwargs; GPT-1 has none;
      BART's decoder and MPT place every token by its cache slot);
    - ALiBi (BLOOM, MPT, Falcon's alibi=True): the bias grows with the key's cache slot, not its tree position;
    - GPT-Neo's local layers: a window over cache slots, which a tree's siblings push its prefix out of.
    (longrope / dynamic RoPE, whose cached keys go stale past their original length, run up to it: model_info's
    context_window stops there.)"""
    cfg, name = model.config, type(model).__name__
    params = inspect.signature(model.forward).parameters
    missing = [arg for arg in ("past_key_values", "position_ids") if arg not in params]
    problem = None
    if cfg.model_type in ("bloom", "mpt") or getattr(cfg, "alibi", False):
        problem = "ALiBi's bias follows a key's cache slot, not its position in the tree"
    elif missing:
        problem = f"its forward takes no {' or '.join(missing)}, which a tree forward passes"
    elif "local" in (getattr(cfg, "attention_layers", None) or []) and \
            getattr(cfg, "window_size", 0) < context_window(model):
        problem = f"its local attention layers window {cfg.window_size} cache slots, not tree positions"
    if problem:
        raise ValueError(f"{name} cannot run tree attention exactly: {problem}")


def check_cache_support(model, hint: str = "") -> None:
    """Refuse models whose cache layers cannot be compacted by gathering (sliding windows, SSM states; `hint`: where
    such a model may run instead), and configs transformers builds no cache for (a Gemma2 with sliding_window None
    and windowed layer types: a TypeError from inside transformers, which its own generate() raises too)."""
    try:
        cache = DynamicCache(config=model.config)
    except Exception as err:  # noqa: BLE001 - whatever transformers raises, the config is the cause
        raise ValueError(f"{type(model).__name__}: transformers cannot build a KV cache for this config "
                         f"({type(err).__name__}: {err}); check its attention settings (sliding_window, "
                         "layer_types)") from err
    bad = [type(layer).__name__ for layer in cache.layers if type(layer) is not DynamicLayer]
    if bad:
        raise ValueError(
            f"{type(model).__name__} uses cache layers {sorted(set(bad))}; arborspec's attention backend needs plain "
            f"full-attention KV caches (sliding-window and state-space layers are not supported by this backend){hint}"
        )
