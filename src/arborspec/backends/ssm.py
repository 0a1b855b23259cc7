"""STree: tree speculative decoding for Mamba2 state-space models and SSM/attention hybrids.

`SSMTreeSession` implements the `Session` protocol (backends/session.py) like `TreeSession`, so every policy and
verifier works unchanged. Supported (transformers 5.23, plain PyTorch, CPU):

- `Mamba2ForCausalLM` (model_type "mamba2");
- `BambaForCausalLM` ("bamba"): Mamba2 mixers interleaved with RoPE attention layers, each followed by an MLP. The
  hybrid family this backend is built and tested on: its mixer is Mamba2's line for line (same parameters, same
  discretisation), its attention is plain Llama-style attention, its layer is two pre-norm residual branches, and it
  runs on CPU with tiny random configs. (FalconH1 runs attention and SSM in parallel inside each layer with muP
  multipliers on every branch; Zamba2 shares attention blocks with per-call LoRA adapters and re-concatenates the
  input embeddings: both are more model code to mirror. NemotronH also works: the same mixer, attention without
  positional embeddings, one mixer per block.)
- `NemotronHForCausalLM` ("nemotron_h").

How one forward runs (the gpt-fast way: the session loops over the model's own layers itself):
the model's embeddings, norms, MLPs, in_proj / out_proj / gated norm, attention modules and lm_head run unchanged;
only the sequence mixing is replaced. SSM mixers run `tree_mixer_forward`: a tree-aware causal conv (each node mixes
with its ancestors, then the committed conv tail) and the tree-masked SSD scan from one committed state
(`ssm_scan.tree_ssd`). Attention layers get an additive float mask (committed prefix + own ancestors), positions
root position + depth, and a small KV store in place of transformers' cache.

Row layout of one step: committed tokens not yet in the state ("pending", a chain) ride in front of the first
forward, then tree nodes; `slot[node]` is the node's offset among the tree rows (as in TreeSession). Nothing but the
rows' activations is kept: per SSM layer the conv inputs and (dt, dt*A, B, x) of each row. `commit(path)` replays the
recurrence along pending + accepted path from those activations (activation replay, STree Alg. 1) and gathers the
attention KV of the same rows; no per-node SSM state is ever stored.

`ssm_tree="unrolled"` is the baseline STree compares against: every root-to-leaf path of the tree is a separate
causal sequence in a batch, each with its own copy of the state, so shared prefixes are recomputed once per path.

Numerics follow transformers' chunked Mamba2 path: the scan runs in float32, dt = clamp(softplus(dt + dt_bias),
*time_step_limit) (the single-token path skips the clamp, which only matters for a non-default limit such as
NemotronH's), D skip, silu(z) gating inside the grouped RMSNorm.

Over 400 lines: STree's session is one algorithm (packed tree scan, activation replay on commit, the attention layers
of hybrids beside the mixers); the scan kernel itself is in ssm_scan.py.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from ..core.sampling import check_finite
from ..core.tree import TokenTree
from .hf import begin_forward, check_path, end_forward
from .session import TreeRegion
from .ssm_scan import chain_states, conv_taps, discretize, new_conv_tail, replay_state, tree_conv, tree_ssd

SSM_MODEL_TYPES = ("mamba2", "bamba", "nemotron_h")
SSM_TREE_MODES = ("packed", "unrolled")


# ---- the model's layers, per family -------------------------------------------------------------------------------
@dataclass
class _Arch:
    embed: torch.nn.Module
    blocks: list
    final_norm: torch.nn.Module
    lm_head: torch.nn.Module
    rotary: torch.nn.Module | None
    run_block: Callable  # (block, hidden, mix) -> hidden; mix(module, x) does the sequence mixing of one layer


def _mamba2_block(block, h, mix):
    residual = h
    x = block.norm(h.to(dtype=block.norm.weight.dtype))
    if block.residual_in_fp32:
        residual = residual.to(torch.float32)
    return residual + mix(block.mixer, x)


def _bamba_block(layer, h, mix):
    x = layer.input_layernorm(h)
    h = h + mix(layer.mamba if layer.block_type == "linear_attention" else layer.self_attn, x)
    return h + layer.feed_forward(layer.pre_ff_layernorm(h))


def _nemotron_h_block(block, h, mix):
    x = block.norm(h.to(dtype=block.norm.weight.dtype))
    if block.block_type in ("linear_attention", "full_attention"):
        return h + mix(block.mixer, x)
    return h + block.mixer(x)  # mlp / moe


def _arch(model) -> _Arch:
    kind = getattr(model.config, "model_type", None)
    if kind == "mamba2":
        bb = model.backbone
        return _Arch(bb.embeddings, list(bb.layers), bb.norm_f, model.lm_head, None, _mamba2_block)
    if kind == "bamba":
        m = model.model
        return _Arch(m.embed_tokens, list(m.layers), m.final_layernorm, model.lm_head, m.rotary_emb, _bamba_block)
    if kind == "nemotron_h":
        m = model.model
        return _Arch(m.embeddings, list(m.layers), m.norm_f, model.lm_head, None, _nemotron_h_block)
    raise ValueError(f"{type(model).__name__} (model_type {kind!r}) is not supported by the SSM tree backend; "
                     f"supported: {', '.join(SSM_MODEL_TYPES)}")


def is_ssm_mixer(module) -> bool:
    return hasattr(module, "A_log") and hasattr(module, "conv1d")


# ---- one SSM layer over a packed tree ----------------------------------------------------------------------------
@dataclass
class RowActs:
    """Per-row activations of one SSM layer, kept for the rest of the step and for activation replay.

    raw (b, R, conv_dim): conv inputs (model dtype); dt, dA, cum (b, R, heads): float32 step size, log-decay dt*A, and
    log-decay summed from the committed state down to the row; B (b, R, groups, state); x (b, R, heads, head_dim).
    """

    raw: torch.Tensor
    dt: torch.Tensor
    dA: torch.Tensor
    cum: torch.Tensor
    B: torch.Tensor
    x: torch.Tensor

    @classmethod
    def empty(cls, mixer, dtype, batch: int = 1) -> "RowActs":
        H, G, N, P = mixer.num_heads, mixer.n_groups, mixer.ssm_state_size, mixer.head_dim
        f32 = torch.float32
        return cls(torch.zeros(batch, 0, mixer.conv_dim, dtype=dtype), torch.zeros(batch, 0, H, dtype=f32),
                   torch.zeros(batch, 0, H, dtype=f32), torch.zeros(batch, 0, H, dtype=f32),
                   torch.zeros(batch, 0, G, N, dtype=dtype), torch.zeros(batch, 0, H, P, dtype=dtype))

    def _map(self, fn) -> "RowActs":
        return RowActs(*(fn(getattr(self, f)) for f in ("raw", "dt", "dA", "cum", "B", "x")))

    def cat(self, other: "RowActs") -> "RowActs":
        return RowActs(*(torch.cat([getattr(self, f), getattr(other, f)], dim=1)
                         for f in ("raw", "dt", "dA", "cum", "B", "x")))

    def rows(self, index: torch.Tensor) -> "RowActs":
        return self._map(lambda t: t[:, index])

    def pick(self, seq: torch.Tensor, pos: torch.Tensor) -> "RowActs":
        """Rows (seq[i], pos[i]) of a batch of sequences, as one batch-1 row list."""
        return self._map(lambda t: t[seq, pos][None])


@dataclass
class TreeInfo:
    """What every layer of one forward shares: conv taps, ancestor mask, attention mask and positions."""

    taps: torch.Tensor  # (b, T, K) into [conv tail | old rows | new rows]
    mask: torch.Tensor  # (b, T, S) bool, S = old rows + new rows: source s is the query row or an ancestor of it
    attn_mask: torch.Tensor | None = None  # (b, 1, T, committed KV + S) additive float
    position_embeddings: tuple | None = None
    kv: "_KVView | None" = None
    new_acts: dict[int, RowActs] = field(default_factory=dict)
    last: torch.Tensor | None = None  # unrolled: (b,) last real position of each path; its final state is computed
    final_states: dict[int, torch.Tensor] = field(default_factory=dict)  # unrolled: layer -> (b, H, P, N)


def tree_mixer_forward(mixer, hidden: torch.Tensor, info: TreeInfo, conv_tail: torch.Tensor,
                       state: torch.Tensor, old: RowActs) -> tuple[torch.Tensor, RowActs]:
    """A Mamba2 mixer over tree rows: the mixer's own projections and norm, tree conv + tree scan in between.

    hidden (b, T, d_model) after the block's norm; conv_tail (K-1, conv_dim) and state (heads, head_dim, state) are the
    committed states; `old` holds the activations of rows forwarded earlier in this step (ancestors of some new rows).
    Returns the mixer's output (b, T, d_model) and the new rows' activations.
    """
    b, T, _ = hidden.shape
    I, H, G = mixer.intermediate_size, mixer.num_heads, mixer.n_groups
    N, P = mixer.ssm_state_size, mixer.head_dim
    gate, raw, dt_raw = mixer.in_proj(hidden).split([I, mixer.conv_dim, H], dim=-1)

    buf = torch.cat([conv_tail.to(raw.dtype).expand(b, -1, -1), old.raw.expand(b, -1, -1), raw], dim=1)
    xBC = mixer.act(tree_conv(buf, info.taps, mixer.conv1d.weight[:, 0], mixer.conv1d.bias)).to(hidden.dtype)
    x, B, C = xBC.split([I, G * N, G * N], dim=-1)
    x, B, C = x.reshape(b, T, H, P), B.reshape(b, T, G, N), C.reshape(b, T, G, N)

    dt, dA = discretize(dt_raw, mixer.dt_bias, mixer.A_log, tuple(mixer.time_step_limit))
    mask = info.mask.expand(b, -1, -1)
    all_dA = torch.cat([old.dA.expand(b, -1, -1), dA], dim=1)
    cum = torch.einsum("bts,bsh->bth", mask.to(all_dA.dtype), all_dA)  # A_tree = L @ log(A)
    new = RowActs(raw, dt, dA, cum, B, x)
    src = old._map(lambda t: t.expand(b, *t.shape[1:])).cat(new) if old.x.shape[1] else new
    y = tree_ssd(C, cum, src.B, src.x, src.dt, src.cum, mask, state.expand(b, -1, -1, -1))
    if info.last is not None:  # the unrolled baseline carries one state per path, as a state-carrying scan does
        info.final_states[mixer.layer_idx] = chain_states(state.expand(b, -1, -1, -1), x, dt, cum, B, info.last)
    y = y + mixer.D.float()[:, None] * x.float()  # D skip
    y = mixer.norm(y.reshape(b, T, I), gate)  # silu(z) gating + grouped RMSNorm
    return mixer.out_proj(y.to(hidden.dtype)), new


# ---- attention layers ----------------------------------------------------------------------------------------------
class _KVView:
    """Stands in for transformers' cache inside one forward: `update` returns [stored KV | this forward's KV]."""

    def __init__(self, store: dict[int, tuple[torch.Tensor, torch.Tensor]], visible: int):
        self.store, self.visible = store, visible  # the first `visible` stored positions are seen by this forward
        self.new: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def update(self, keys, values, layer_idx, *args, **kwargs):
        self.new[layer_idx] = (keys, values)
        if layer_idx not in self.store:
            return keys, values
        k0, v0 = (t[:, :, : self.visible] for t in self.store[layer_idx])
        b = keys.shape[0]
        return (torch.cat([k0.expand(b, -1, -1, -1), keys], dim=-2),
                torch.cat([v0.expand(b, -1, -1, -1), values], dim=-2))


# ---- the session ---------------------------------------------------------------------------------------------------
class SSMTreeSession(TreeRegion):
    """One sequence's SSM states (and attention KV) on one Mamba2 / hybrid model, with a speculative tree region."""

    def __init__(self, model, role: str = "target", ssm_tree: str = "packed", max_ride: int = 64,
                 prefill_chunk: int = 256, path_states: bool = True):
        if ssm_tree not in SSM_TREE_MODES:
            raise ValueError(f"unknown ssm_tree {ssm_tree!r}; choose one of: {', '.join(SSM_TREE_MODES)}")
        self.model, self.role, self.ssm_tree = model, role, ssm_tree
        self.arch = _arch(model)
        self.max_ride, self.prefill_chunk = max_ride, prefill_chunk
        self.keep_path_states = path_states  # unrolled: carry one state per path (False isolates the repeated tokens)
        self.cached: list[int] = []  # committed token ids (the states hold them, or their rows will be replayed)
        self.tree: TokenTree | None = None
        self.slot: dict[int, int] = {}  # tree node -> offset among this step's tree rows
        self.forwards = 0
        self.dtype = self.arch.embed.weight.dtype
        self._mixers: dict[int, torch.nn.Module] = {}
        for i, block in enumerate(self.arch.blocks):
            for mod in block.children():
                if is_ssm_mixer(mod):
                    self._mixers[i] = mod
        if not self._mixers:
            raise ValueError(f"{type(model).__name__} has no Mamba2 mixer")
        self.kernel = next(iter(self._mixers.values())).conv_kernel_size
        self.has_attention = model.config.model_type != "mamba2"
        # committed state
        self.conv_state = {i: torch.zeros(m.conv_kernel_size - 1, m.conv_dim, dtype=self.dtype)
                           for i, m in self._mixers.items()}
        self.ssm_state = {i: torch.zeros(m.num_heads, m.head_dim, m.ssm_state_size, dtype=torch.float32)
                          for i, m in self._mixers.items()}
        self.kv: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # attention layer -> [committed | rows] K, V
        self.kv_committed = 0
        self._reset_rows()

    def _reset_rows(self) -> None:
        self._parent: list[int] = []  # row -> parent row (-1: follows the committed sequence)
        self._n_pending = 0  # rows 0.._n_pending-1 are pending committed tokens, the rest tree nodes
        self._anc = torch.zeros(0, 0, dtype=torch.bool)  # (R, R) row ancestor-or-self mask
        self._row_ids: list[int] = []
        self._row_pos: list[int] = []
        self.path_states: dict[int, torch.Tensor] = {}  # unrolled mode only: per-path final states of this step
        self._acts = {i: RowActs.empty(m, self.dtype) for i, m in self._mixers.items()}
        self.region_len = 0  # tree rows of this step (after `renumber`, some belong to no node)

    def forward(self, context: list[int], tree: TokenTree, nodes: list[int]) -> torch.Tensor:
        """Logits (len(nodes), vocab) for `nodes` of `tree`, whose root is context[-1] (parents before children)."""
        pending = begin_forward(self, context, tree, nodes)
        if len(pending) > self.max_ride:  # a long catch-up goes through the chunked prefill first
            head = pending[: len(pending) - self.max_ride]
            self.prefill(head)
            pending = pending[len(head):]
        first = len(self._parent)
        parents, positions, ids = [], [], []
        for i, tok in enumerate(pending):
            parents.append(first + i - 1)
            positions.append(len(self.cached) + i)
            ids.append(tok)
        new_slot: dict[int, int] = {}
        root_pos = len(context) - 1
        base = first + len(pending)
        for j, node in enumerate(nodes):
            if node == 0:
                parent_row = base - 1 if pending else (self._n_pending - 1 if self._n_pending else -1)
            else:
                par = tree.parents[node]
                if par in new_slot:
                    parent_row = base + new_slot[par] - self.region_len
                elif par in self.slot:
                    parent_row = self._n_pending + self.slot[par]
                else:
                    raise RuntimeError(f"node {node}'s ancestor {par} has not been forwarded")
            new_slot[node] = self.region_len + j
            parents.append(parent_row)
            positions.append(root_pos + tree.depths[node])
            ids.append(tree.tokens[node])
        if pending:
            self._n_pending = len(pending)
        hidden = self._run(ids, parents, positions)[:, len(pending):]
        logits = self._logits(hidden)
        end_forward(self, pending, new_slot)
        return logits

    def prefill(self, ids: list[int]) -> None:
        """Put committed tokens into the states (chunked; no logits)."""
        if self.region_len or self._parent:
            raise RuntimeError("prefill with a non-empty region")
        ids = list(ids)
        for start in range(0, len(ids), self.prefill_chunk):
            chunk = ids[start : start + self.prefill_chunk]
            n = len(self.cached)
            self._run(chunk, [i - 1 for i in range(len(chunk))], [n + i for i in range(len(chunk))])
            self._commit_rows(list(range(len(chunk))))
            self.cached.extend(chunk)

    def commit(self, path: list[int]) -> None:
        """Keep the committed sequence plus `path` (root first, a chain): replay the states along it, drop the rest."""
        check_path(self, path)
        rows = list(range(self._n_pending)) + [self._n_pending + self.slot[n] for n in path]
        self._commit_rows(rows)
        if path:
            self.cached.extend(self.tree.tokens[n] for n in path)
        self.slot = {}
        self.tree = None

    # ---- internals -------------------------------------------------------------------------------------------------
    def _commit_rows(self, rows: list[int]) -> None:
        """Fold the chain of `rows` into the committed states (activation replay) and clear this step's rows."""
        if not rows and not self._parent:
            return
        prev = -1
        for r in rows:
            if self._parent[r] != prev:
                raise ValueError("commit() needs a chain from the root (each node the child of the one before)")
            prev = r
        index = torch.tensor(rows, dtype=torch.long)
        for i, acts in self._acts.items():
            kept = acts.rows(index)
            self.ssm_state[i] = replay_state(self.ssm_state[i], kept.x[0], kept.dt[0], kept.dA[0], kept.B[0])
            self.conv_state[i] = new_conv_tail(self.conv_state[i], kept.raw[0])
        keep = torch.cat([torch.arange(self.kv_committed), self.kv_committed + index])
        for layer, (k, v) in self.kv.items():
            self.kv[layer] = (k.index_select(-2, keep), v.index_select(-2, keep))
        self.kv_committed += len(rows)
        self._reset_rows()

    @torch.inference_mode()
    def _run(self, ids: list[int], parents: list[int], positions: list[int]) -> torch.Tensor:
        """Run the new rows through the model; returns their last hidden states (1, T, d_model) before the final norm.

        Appends the rows to this step's rows (parents, ancestor mask, per-layer activations, attention KV).
        """
        first = len(self._parent)
        all_parents = self._parent + parents
        T = len(ids)
        anc = torch.zeros(first + T, first + T, dtype=torch.bool)
        anc[:first, :first] = self._anc
        for j, p in enumerate(parents):
            r = first + j
            if p >= 0:
                anc[r] = anc[p]
            anc[r, r] = True
        if self.ssm_tree == "unrolled" and T > 1:
            hidden = self._run_unrolled(ids, all_parents, positions, first, anc)
        else:
            taps = conv_taps(all_parents, self.kernel, list(range(first, first + T)))[None]
            info = TreeInfo(taps=taps, mask=anc[first:, :][None])
            pos = torch.tensor([positions])
            hidden = self._layers(torch.tensor([ids]), pos, info, old=True)
            for i, new in info.new_acts.items():
                self._acts[i] = self._acts[i].cat(new)
            for layer, (k, v) in (info.kv.new.items() if info.kv else ()):
                self._store_kv(layer, k, v)
        self._parent, self._anc = all_parents, anc
        self._row_ids += ids
        self._row_pos += positions
        self.forwards += 1
        return hidden

    def _run_unrolled(self, ids, all_parents, positions, first, anc) -> torch.Tensor:
        """The baseline: each root-to-leaf path through the new rows as its own causal sequence, all in one batch."""
        T = len(ids)
        new_rows = list(range(first, first + T))
        has_child = {all_parents[r] for r in new_rows}
        leaves = [r for r in new_rows if r not in has_child]
        chains = [torch.nonzero(anc[leaf]).flatten().tolist() for leaf in leaves]  # rows are stored parents first
        L = max(len(c) for c in chains)
        row_ids, row_pos = self._row_ids + list(ids), self._row_pos + list(positions)
        batch_ids = torch.zeros(len(chains), L, dtype=torch.long)
        batch_pos = torch.zeros(len(chains), L, dtype=torch.long)
        where: dict[int, tuple[int, int]] = {}
        for b, chain in enumerate(chains):
            pad = chain + [chain[-1]] * (L - len(chain))  # right padding never reaches real rows (causal)
            batch_ids[b] = torch.tensor([row_ids[r] for r in pad])
            batch_pos[b] = torch.tensor([row_pos[r] for r in chain] + [row_pos[chain[-1]]] * (L - len(chain)))
            for pos, r in enumerate(chain):
                if r >= first:
                    where.setdefault(r, (b, pos))
        taps = conv_taps(list(range(-1, L - 1)), self.kernel, list(range(L)))[None].expand(len(chains), -1, -1)
        causal = torch.ones(L, L, dtype=torch.bool).tril()[None]
        last = torch.tensor([len(c) - 1 for c in chains]) if self.keep_path_states else None
        info = TreeInfo(taps=taps, mask=causal, last=last)
        hidden = self._layers(batch_ids, batch_pos, info, old=False)
        self.path_states = info.final_states  # one state per path and layer, held until commit (the baseline's cache)
        seq = torch.tensor([where[r][0] for r in new_rows])
        pos = torch.tensor([where[r][1] for r in new_rows])
        for i, acts in info.new_acts.items():
            self._acts[i] = self._acts[i].cat(acts.pick(seq, pos))
        for layer, (k, v) in (info.kv.new.items() if info.kv else ()):
            self._store_kv(layer, k[seq, :, pos].transpose(0, 1)[None], v[seq, :, pos].transpose(0, 1)[None])
        return hidden[seq, pos][None]

    def _store_kv(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        if layer in self.kv:
            k0, v0 = self.kv[layer]
            k, v = torch.cat([k0, k], dim=-2), torch.cat([v0, v], dim=-2)
        self.kv[layer] = (k, v)

    def _layers(self, ids: torch.Tensor, positions: torch.Tensor, info: TreeInfo, old: bool) -> torch.Tensor:
        """Embeddings and every block, with sequence mixing done on the tree rows; (b, T, d_model)."""
        arch = self.arch
        hidden = arch.embed(ids)
        b, T = ids.shape
        if self.has_attention:  # each row sees the committed prefix and its own ancestors
            mask = info.mask.expand(b, -1, -1)
            attn = torch.zeros(b, 1, T, self.kv_committed + mask.shape[-1], dtype=self.dtype)
            attn[:, 0, :, self.kv_committed:].masked_fill_(~mask, torch.finfo(self.dtype).min)
            info.attn_mask = attn
            info.kv = _KVView(self.kv, self.kv_committed + (mask.shape[-1] - T))
        if arch.rotary is not None:
            info.position_embeddings = arch.rotary(hidden, position_ids=positions)

        def mix(i, module, x):
            if i in self._mixers and module is self._mixers[i]:
                prev = self._acts[i] if old else RowActs.empty(module, self.dtype)
                out, new = tree_mixer_forward(module, x, info, self.conv_state[i], self.ssm_state[i], prev)
                info.new_acts[i] = new
                return out
            kw = dict(hidden_states=x, attention_mask=info.attn_mask, past_key_values=info.kv)
            if info.position_embeddings is not None:
                kw["position_embeddings"] = info.position_embeddings
            return module(**kw)[0]

        for i, block in enumerate(arch.blocks):
            hidden = arch.run_block(block, hidden, lambda module, x, i=i: mix(i, module, x))
        return hidden

    @torch.inference_mode()
    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        head = self.arch.lm_head
        logits = head(self.arch.final_norm(hidden).to(_input_dtype(head)))[0].float()
        check_finite(logits, self.role)
        return logits


def _input_dtype(module: torch.nn.Module) -> torch.dtype:
    """The dtype `module` takes: its first float parameter's (a pruned head's projection, a plain linear), float32
    for a dynamically quantized linear (it has no float parameters and quantizes float32 inputs itself)."""
    p = next((p for p in module.parameters() if p.is_floating_point()), None)
    return p.dtype if p is not None else torch.float32


def check_ssm_support(model) -> None:
    """Raise ValueError unless `model` is a Mamba2 / Bamba / NemotronH causal LM this backend can run."""
    _arch(model)
