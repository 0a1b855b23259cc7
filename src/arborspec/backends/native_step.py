"""The native backend's sessions, on the C++ step (kernels/forward.cpp): one operator call per forward.

Why: the Python forward (native_forward.py) spends 4.3 ms a forward and 3.8 ms per extra row outside the kernels on
the 1.5B target (Zen 4, docs/kernels.md): a dozen torch calls per layer and one attention call per row and layer.
The C++ step runs the layer loop and tree attention itself, so Python only describes the rows: for each row its token,
its position, where its key and value go in the cache, and which cache entries it sees (the committed prefix, then
the region slots of its tree ancestors and itself, read from the tree's parents, not from a dense mask).

A `NativeSession` owns its KV cache: keys and values as two float32 tensors (layers, kv_heads, capacity, head_dim),
grown by doubling as needed (positions are held to the model's context window), laid out

    [ committed prefix (len(cached)) | speculative region: tree nodes forwarded this step ]

as `hf.TreeSession`'s, with the same operations: append (forward), keep an accepted path (`commit`: a gather within
the tensors), `truncate`, `fork`. Memory: 2 x layers x kv_heads x head_dim x 4 bytes per token: 57 KiB for the
1.5B target (28 x 2 x 128), 24 KiB for the 0.5B draft (24 x 2 x 64); a 4096-token sequence holds 235 MB and 98 MB.

Every index is checked here before the call (the operator checks again and raises, never crashes). Several
sessions' forwards in one batching round run as ONE operator call (`StepForward.many`): the weights are read once
for every request's rows, and attention runs per row on its own sequence's cache, so each request's logits are the
bits it gets alone.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass
from types import MethodType

import torch

from ..core.sampling import non_finite
from ..core.tree import TokenTree
from . import batching
from .hf import begin_forward, check_path, end_forward
from .model_info import context_window
from .native_forward import FastForward
from .session import TreeRegion

FIRST_CAPACITY = 256  # cache entries allocated at a session's first forward; doubled when full


class ContextOverflow(ValueError):
    """A forward would take a sequence past the model's context window (nothing was run)."""


@dataclass
class StepCall:
    """One session's rows for one forward (see forward.cpp's `Model.forward` for each table's meaning)."""

    session: "NativeSession"
    ids: list[int]
    positions: list[int]
    at: list[int]  # where each row's key and value go in the session's cache
    prefix: list[int]  # each row sees cache entries [0, prefix) ...
    extra: list[list[int]]  # ... and these (ascending, >= prefix)
    keep: list[int]  # rows whose logits are returned


class Step:
    """A native model's weights handed to the C++ operator once (the blocks are shared, not copied)."""

    def __init__(self, fast: FastForward, ops: str = "arborspec_kernels"):
        """`ops`: the kernels' torch namespace (the tests also run "arborspec_kernels_emulated", kernels/build.py)."""
        layer0 = fast.layers[0]
        self.layers, self.kv_heads, self.head_dim = len(fast.layers), layer0.kv_heads, layer0.head_dim
        self.vocab = fast.embed.matrix.n
        self.context = context_window(fast.model)
        self.rotary = fast.rotary
        self.angles = (torch.empty(0), torch.empty(0))  # cos, sin (positions, head_dim): see `cos_sin`
        self.cpp = getattr(torch.classes, ops).Model(fast.dim, layer0.heads, layer0.kv_heads, layer0.head_dim,
                                                        float(layer0.eps), float(fast.norm.variance_epsilon))
        for index, layer in enumerate(fast.layers):
            self.cpp.add_layer(layer.norm1, layer.norm2)
            for which, products in (("qkv", layer.qkv), ("o", [layer.o]), ("gate_up", layer.gate_up),
                                    ("down", [layer.down])):
                self._product(index, which, products)
        self._product(-1, "head", [fast.head])
        self.cpp.set_embedding(fast.embed.matrix.data, int(fast.embed.matrix.qtype), self.vocab)
        self.cpp.set_final_norm(fast.norm.weight)
        if hasattr(fast.head, "keep"):  # a pruned head (native.PrunedQuantHead): the step spreads its logits
            self.cpp.set_head_ids(fast.head.keep, fast.head.vocab_size)

    def _product(self, index: int, which: str, linears) -> None:
        """QuantLinear modules over one input (native_forward.merge's groups), outputs side by side."""
        biases = [lin.bias for lin in linears]
        bias = None if all(b is None for b in biases) else torch.cat(
            [torch.zeros(lin.out_features) if b is None else b.float() for lin, b in zip(linears, biases)])
        self.cpp.set_product(index, which, [lin.matrix.data for lin in linears],
                             [lin.matrix.layout for lin in linears], linears[0].matrix.k, bias)

    def run(self, calls: list[StepCall]) -> list[torch.Tensor]:
        """Every call's rows in one operator call -> each call's logits (len(keep), vocab) float32."""
        ids, positions, seq, at, prefix, offsets, extra, keep = [], [], [], [], [], [0], [], []
        for s, call in enumerate(calls):
            start = len(ids)
            ids += call.ids
            positions += call.positions
            seq += [s] * len(call.ids)
            at += call.at
            prefix += call.prefix
            for entries in call.extra:
                extra += entries
                offsets.append(len(extra))
            keep += [start + r for r in call.keep]
        long = lambda values: torch.tensor(values, dtype=torch.long)  # noqa: E731
        rows = long([ids, positions, seq, at, prefix])  # (5, n): each row a contiguous table
        cos, sin = self.cos_sin(rows[1], max(positions))
        try:
            logits = self.cpp.forward(rows[0], cos, sin, [c.session.keys for c in calls],
                                      [c.session.values for c in calls], rows[2], rows[3], rows[4], long(offsets),
                                      long(extra), long(keep))
        except RuntimeError as err:  # the operator checks the logits where they are still in cache
            if "non-finite logits" not in str(err):
                raise
            raise non_finite(calls[0].session.role) from None
        if len(calls) == 1:
            return [logits]
        return list(logits.split([len(c.keep) for c in calls])) if keep else [logits[:0]] * len(calls)

    def cos_sin(self, positions: torch.Tensor, top: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The rotary cos and sin (n, head_dim) of `positions` (n,), rows of a table computed once for positions
        [0, 2^k) as they are first needed: a position's values are then the same bits whatever else the forward holds,
        and a draft call saves the rotary module's ~50 us (its torch calls run cold after the weights streamed past).
        A rope that rescales with the sequence length ("dynamic") is computed per call, as transformers does."""
        if getattr(self.rotary, "rope_type", "default") == "dynamic":
            cos, sin = self.rotary(torch.empty(1, dtype=torch.float32), positions[None])  # (1, n, head_dim)
            return cos[0].contiguous(), sin[0].contiguous()
        if top >= len(self.angles[0]):
            size = min(max(1024, 2 * len(self.angles[0]), 1 << top.bit_length()), self.context)
            cos, sin = self.rotary(torch.empty(1, dtype=torch.float32), torch.arange(size)[None])
            self.angles = (cos[0].contiguous(), sin[0].contiguous())
        return self.angles[0].index_select(0, positions), self.angles[1].index_select(0, positions)


class StepForward(FastForward):
    """The native model's forward: session calls (`step=StepCall`) on the C++ step, anything else as FastForward
    (the Python forward for hf-style tree calls, transformers' for the rest)."""

    def __init__(self, model):
        super().__init__(model)
        self.step = Step(self)

    def __call__(self, step: StepCall | None = None, **call):
        if step is None:
            return super().__call__(**call)
        return self.step.run([step])[0]

    def many(self, calls: list[dict]) -> list:
        """Each call's output in order: the session calls as ONE C++ forward, the others as FastForward.many."""
        steps = [j for j, call in enumerate(calls) if "step" in call]
        others = [j for j, call in enumerate(calls) if "step" not in call]
        outputs: list = [None] * len(calls)
        if steps:
            for j, out in zip(steps, self.step.run([calls[j]["step"] for j in steps])):
                outputs[j] = out
        if others:
            for j, out in zip(others, super().many([calls[j] for j in others])):
                outputs[j] = out
        return outputs


class NativeSession(TreeRegion):
    """One sequence on a native model, its KV cache owned here (implements `session.Session`)."""

    # A row's keys, values and logits do not depend on the other rows of its call (kernels/forward.cpp), so a prompt
    # read in pieces (SpeculativeDecoder.steps' prefill_chunk) or kept from another request is the same bits.
    rows_alone = True

    def __init__(self, model, role: str = "target"):
        self.model, self.role = model, role
        self.step: Step = model.forward.step
        shape = (self.step.layers, self.step.kv_heads, 0, self.step.head_dim)
        self.keys, self.values = torch.empty(shape), torch.empty(shape)  # (layers, KV, capacity, d)
        self.cached: list[int] = []  # committed token ids whose keys and values are in the cache
        self.tree: TokenTree | None = None
        self.slot: dict[int, int] = {}  # tree node -> offset in the region
        self.region_len = 0
        self.forwards = 0

    @property
    def length(self) -> int:
        """Cache entries in use: the committed prefix and the region."""
        return len(self.cached) + self.region_len

    def forward(self, context: list[int], tree: TokenTree, nodes: list[int]) -> torch.Tensor:
        """Logits (len(nodes), vocab) for `nodes` of `tree` (see session.Session.forward)."""
        pending = begin_forward(self, context, tree, nodes)
        committed, p = len(self.cached), len(pending)
        base = committed + p  # where the region starts once the pending tokens are committed
        new_slot = {node: self.region_len + j for j, node in enumerate(nodes)}
        extra = []
        for node in nodes:
            slots = [self.slot.get(anc, new_slot.get(anc)) for anc in tree.path(node)]
            if None in slots:
                raise RuntimeError(f"node {node}'s ancestor {tree.path(node)[slots.index(None)]} has not been forwarded")
            extra.append(sorted(base + s for s in slots))
        root_pos = len(context) - 1
        logits = self._run(ids=pending + [tree.tokens[n] for n in nodes],
                           positions=list(range(committed, base)) + [root_pos + tree.depths[n] for n in nodes],
                           prefix=[committed + i + 1 for i in range(p)] + [base] * len(nodes),
                           extra=[[] for _ in range(p)] + extra, keep=list(range(p, p + len(nodes))))
        end_forward(self, pending, new_slot)
        return logits

    def prefill(self, ids: list[int]) -> None:
        """Put committed tokens into the cache (a causal chain), computing no logits."""
        if self.region_len:
            raise RuntimeError("prefill with a non-empty region")
        if not ids:
            return
        past = len(self.cached)
        self._run(ids=list(ids), positions=list(range(past, past + len(ids))),
                  prefix=[past + i + 1 for i in range(len(ids))], extra=[[] for _ in ids], keep=[])
        self.cached.extend(ids)

    def commit(self, path: list[int]) -> None:
        """Keep the committed prefix plus the region slots of `path` (root first, a chain): gathered in place."""
        check_path(self, path)
        base = len(self.cached)
        slots = [self.slot[n] for n in path]
        if slots != list(range(len(slots))):
            index = torch.tensor(slots, dtype=torch.long) + base
            for cache in (self.keys, self.values):
                cache[:, :, base:base + len(slots)] = cache[:, :, index]  # the right side is a copy: no overlap
        self.cached.extend(self.tree.tokens[n] for n in path)
        self.slot, self.region_len, self.tree = {}, 0, None

    def truncate(self, length: int) -> None:
        """Forget committed tokens past the first `length` (no region may be open)."""
        if self.region_len or not 0 <= length <= len(self.cached):
            raise ValueError(f"truncate({length}) needs an empty region and 0 <= length <= {len(self.cached)}")
        del self.cached[length:]

    def fork(self) -> "NativeSession":
        """A second session with a copy of this one's committed state (no region may be open)."""
        if self.region_len:
            raise RuntimeError("fork with a non-empty region")
        twin = NativeSession(self.model, self.role)
        twin.keys, twin.values = self.keys.clone(), self.values.clone()
        twin.cached = list(self.cached)
        return twin

    # ---- internals --------------------------------------------------------------------------------------------
    def _run(self, ids, positions, prefix, extra, keep) -> torch.Tensor:
        limit = self.step.context
        if max(positions) >= limit:
            raise ContextOverflow(f"{self.role}: position {max(positions)} is past the model's context window of "
                                  f"{limit} tokens")
        start = self.length
        self._reserve(start + len(ids))
        vocab = self.step.vocab
        if any(not 0 <= t < vocab for t in ids):
            raise ValueError(f"token ids must lie in [0, {vocab})")
        call = StepCall(self, list(ids), positions, list(range(start, start + len(ids))), prefix, extra, keep)
        with torch.inference_mode():
            logits = batching.forward(self.model, {"step": call}, self.role)  # (len(keep), vocab)
        self.forwards += 1  # the step has checked the logits (Step.run: NaN or inf -> FloatingPointError)
        return logits

    def _reserve(self, needed: int) -> None:
        """Room for `needed` cache entries: capacity doubled, copying the entries in use. (Entries, not positions:
        a wide tree's region may hold more entries than the context window has positions.)"""
        capacity = self.keys.shape[2]
        if needed <= capacity:
            return
        grown = max(FIRST_CAPACITY, capacity)
        while grown < needed:
            grown *= 2
        used = self.length
        for name in ("keys", "values"):
            old = getattr(self, name)
            new = torch.empty(old.shape[0], old.shape[1], grown, old.shape[3])
            new[:, :, :used] = old[:, :, :used]
            setattr(self, name, new)


def install_twin(twin, model) -> None:
    """`twin` shares `model`'s layers with a head of its own (backends/native.with_pruned_head): a forward of its own
    over the same layer objects (merged once, for both), and sessions of its own."""
    forward = copy.copy(model.forward)
    forward.model, forward.head = twin, twin.lm_head
    forward.fallback = MethodType(type(twin).forward, twin)  # transformers' forward, through the twin's own head
    twin.forward = forward
    if isinstance(forward, StepForward):
        forward.step = Step(forward)
        twin.new_session = lambda role="target": NativeSession(twin, role)


def install(model) -> None:
    """Make `model` (a native Qwen2 / Llama) run its sessions on the C++ step (`make_session` finds `new_session`).
    A head size the step's vector code does not take (not a multiple of 8; no Qwen2 / Llama release has one) keeps
    the Python forward and hf.TreeSession's sessions."""
    config = model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    if head_dim % 8:
        model.forward = FastForward(model)
        return
    model.forward = StepForward(model)
    model.new_session = lambda role="target": NativeSession(model, role)
