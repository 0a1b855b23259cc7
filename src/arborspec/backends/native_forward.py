"""The native backend's decoding forward: a Qwen2 / Llama decoder written out as a dozen tensor operations per layer.

Why not transformers' own forward: on a CPU, one decoding step of the 1.5B target spends ~34 ms in the kernels
(the weights' memory time) and ~21 ms more in transformers' module calls, mask and cache bookkeeping and Python; this
forward does the same arithmetic with ~15 ms around the kernels, attention included. It merges the products that
share an input into one kernel call (q, k and v where they have one block type; gate and up), which halves the
kernels' thread hand-offs, and it computes every row independently of the others in its forward (see `attention`),
so that speculation on this backend is exact token for token.

It is installed on the model as its forward for the calls a `hf.TreeSession` makes (token ids, positions, a 4-D
additive mask, a `DynamicCache`, the rows to keep) and hands any other call to transformers' forward, which still
works: every module keeps its weights (the merged matrices are views of the same blocks).
"""
from __future__ import annotations

from types import SimpleNamespace

import torch
import torch.nn.functional as F

from ..kernels import QuantMatrix


def merge(linears) -> list:
    """The products of `linears` (QuantLinear modules over one input, in output order) as few kernel calls as their
    block types allow: consecutive modules of one type become one QuantLinear over their rows (a view of their own
    blocks) with their biases side by side (zeros for a module without one)."""
    groups = [[linears[0]]]
    for lin in linears[1:]:
        last = groups[-1][0].matrix
        if lin.matrix.qtype == last.qtype and lin.matrix.layout == last.layout:
            groups[-1].append(lin)
        else:
            groups.append([lin])
    return [group[0] if len(group) == 1 else _merged(group) for group in groups]


def _merged(group):
    whole = QuantMatrix.concat([lin.matrix for lin in group])
    for lin in group:  # the modules' buffers follow their matrices to the views (or the blocks are held twice)
        lin.blocks = lin.matrix.data
    biases = [lin.bias for lin in group]
    bias = None if all(b is None for b in biases) else torch.cat(
        [torch.zeros(lin.out_features) if b is None else b for lin, b in zip(group, biases)])
    return type(group[0])(whole, bias)  # a QuantLinear (backends/native.py imports this module: no import back)


def run(products, x: torch.Tensor) -> torch.Tensor:
    """x (m, k) through `merge`'s products -> their outputs side by side (m, sum of out_features)."""
    return products[0](x) if len(products) == 1 else torch.cat([p(x) for p in products], dim=-1)


class Layer:
    """One decoder layer's weights as the fast forward uses them."""

    def __init__(self, layer, config):
        attn, mlp = layer.self_attn, layer.mlp
        self.heads, self.kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.heads
        self.eps = config.rms_norm_eps
        self.norm1, self.norm2 = layer.input_layernorm.weight, layer.post_attention_layernorm.weight
        self.qkv = merge([attn.q_proj, attn.k_proj, attn.v_proj])  # one call where the three share a block type
        self.o = attn.o_proj
        self.gate_up = merge([mlp.gate_proj, mlp.up_proj])
        self.down = mlp.down_proj

    def project_qkv(self, x: torch.Tensor) -> torch.Tensor:
        """x (m, hidden) -> (m, (heads + 2 kv_heads) x head_dim): q, k, v side by side."""
        return run(self.qkv, x)

    def mlp(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = run(self.gate_up, x).chunk(2, dim=-1)
        return self.down(F.silu(gate) * up)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding, halves layout (as transformers' Qwen2 / Llama): x (1, heads, q, d), cos/sin (1, 1, q, d)."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


class FastForward:
    """Replaces `model.forward` (see the module docstring); `fallback` is transformers' forward. `many` runs several
    calls (different requests' sessions) as one forward: backends/batching.py batches a round's target forwards so."""

    def __init__(self, model):
        self.model = model
        self.fallback = model.forward
        self.layers = [Layer(layer, model.config) for layer in model.model.layers]
        self.embed, self.norm, self.head = model.model.embed_tokens, model.model.norm, model.lm_head
        self.rotary = model.model.rotary_emb
        self.dim = model.config.hidden_size

    def __call__(self, input_ids=None, position_ids=None, attention_mask=None, past_key_values=None, use_cache=True,
                 logits_to_keep=None, **extra):
        call = dict(input_ids=input_ids, position_ids=position_ids, attention_mask=attention_mask,
                    past_key_values=past_key_values, use_cache=use_cache, logits_to_keep=logits_to_keep, **extra)
        if not fits(call):  # only what the caller gave: transformers reads logits_to_keep=None as a new axis
            return self.fallback(**{k: v for k, v in call.items() if v is not None or k in extra})
        with torch.inference_mode():
            return SimpleNamespace(logits=self.forward_many([call])[0])

    def many(self, calls: list[dict]) -> list:
        """Each call's output (keyword arguments as `__call__` takes them), in order: the tree-session calls as ONE
        `forward_many`, any other call by transformers' forward on its own."""
        outputs = [None if fits(call) else self.fallback(**call) for call in calls]
        fast = [j for j, call in enumerate(calls) if outputs[j] is None]
        if fast:
            with torch.inference_mode():
                logits = self.forward_many([calls[j] for j in fast])
            for j, out in zip(fast, logits):
                outputs[j] = SimpleNamespace(logits=out)
        return outputs

    def forward_many(self, calls: list[dict]) -> list[torch.Tensor]:
        """Tree-session calls (see `fits`) -> each one's logits (1, len(keep), vocab).

        Every product (the embedding, q/k/v, o, gate/up, down, the head) runs once over all calls' rows side by
        side, so the weights are read once for all of them; attention runs per call, on the call's own cache. No
        operation mixes rows (the kernels are row-independent, `attention` runs each row alone), so a call's logits
        are bit for bit what it gets alone, whoever shares its forward."""
        sizes = [call["input_ids"].shape[1] for call in calls]
        ids = torch.cat([call["input_ids"][0] for call in calls])  # (rows,) every call's rows, call after call
        positions = torch.cat([call["position_ids"] for call in calls], dim=1)  # (1, rows)
        h = self.embed(ids)  # (rows, hidden)
        cos, sin = self.rotary(h[None], positions)  # (1, rows, head_dim) each
        cos, sin = cos[:, None], sin[:, None]  # (1, 1, rows, head_dim)
        seqs = [(n, call["past_key_values"], visible_keys(call["attention_mask"])) for n, call in zip(sizes, calls)]
        for index, layer in enumerate(self.layers):
            h = h + self.attention(layer, index, F.rms_norm(h, (self.dim,), layer.norm1, layer.eps), cos, sin, seqs)
            h = h + layer.mlp(F.rms_norm(h, (self.dim,), layer.norm2, layer.eps))
        starts = [sum(sizes[:j]) for j in range(len(sizes))]
        keep = torch.cat([call["logits_to_keep"] + start for call, start in zip(calls, starts)])
        h = F.rms_norm(h[keep], (self.dim,), self.norm.weight, self.norm.variance_epsilon)
        logits = self.head(h)  # (kept rows of every call, vocab)
        return [part[None] for part in logits.split([len(call["logits_to_keep"]) for call in calls])]

    @staticmethod
    def attention(layer: Layer, index: int, x, cos, sin, seqs) -> torch.Tensor:
        """x (rows, hidden) -> (rows, hidden): tree attention; `seqs` lists (rows, cache, seen) per call, in row
        order: its rows attend to its cache plus its own new tokens, row i to the keys seen[i].

        Each row attends on its own, to exactly the keys it may see, in cache order: the same call, on the same
        numbers, as when that token is decoded alone after its path was committed. So a token's logits do not
        depend on which other nodes (or other requests' rows) share its forward, and greedy speculation reproduces
        plain greedy decoding token for token (a masked batch would round differently, and 8-bit activations turn
        such rounding into ~1% logit differences at quantization-step boundaries; docs/kernels.md)."""
        rows, d = x.shape[0], layer.head_dim
        qkv = layer.project_qkv(x)  # (rows, (H + 2 KV) d)
        q, k, v = qkv.split([layer.heads * d, layer.kv_heads * d, layer.kv_heads * d], dim=-1)
        q = rotate(q.view(rows, layer.heads, d).transpose(0, 1)[None], cos, sin)  # (1, H, rows, d)
        k = rotate(k.view(rows, layer.kv_heads, d).transpose(0, 1)[None], cos, sin)  # (1, KV, rows, d)
        v = v.reshape(rows, layer.kv_heads, d).transpose(0, 1)[None]
        out, start = [], 0
        for n, cache, seen in seqs:
            mine = slice(start, start + n)
            keys, values = cache.update(k[:, :, mine], v[:, :, mine], index)  # (1, KV, past + n, d)
            for i, idx in enumerate(seen):
                if isinstance(idx, int):  # the first idx keys: a view, no copy
                    kk, vv = keys[:, :, :idx], values[:, :, :idx]
                else:
                    kk, vv = keys.index_select(2, idx), values.index_select(2, idx)
                row = q[:, :, start + i:start + i + 1]
                out.append(F.scaled_dot_product_attention(row, kk, vv, enable_gqa=True))  # (1, H, 1, d)
            start += n
        out = torch.cat(out, dim=2) if len(out) > 1 else out[0]  # (1, H, rows, d)
        return layer.o(out[0].transpose(0, 1).reshape(rows, layer.heads * d))


SESSION_CALL = {"input_ids", "position_ids", "attention_mask", "past_key_values", "use_cache", "logits_to_keep"}


def fits(call: dict) -> bool:
    """Whether a forward call is a tree session's (token ids and positions of one sequence, a 4-D additive mask, a
    cache, kept rows as a tensor), which the fast forward runs; anything else goes to transformers' forward."""
    ids, mask = call.get("input_ids"), call.get("attention_mask")
    return (set(call) <= SESSION_CALL and ids is not None and ids.shape[0] == 1
            and call.get("position_ids") is not None and call.get("past_key_values") is not None
            and isinstance(mask, torch.Tensor) and mask.dim() == 4
            and isinstance(call.get("logits_to_keep"), torch.Tensor))


def visible_keys(mask: torch.Tensor) -> list[int | torch.Tensor]:
    """Per query row of an additive mask (1, 1, q, kv): the keys it may see, as a count when they are the first
    ones (a causal prefix, a chain's rows, a tree's first path: no gather needed), else their indices."""
    out = []
    for row in (mask[0, 0] == 0):  # (kv,) bool
        idx = row.nonzero().squeeze(1)
        out.append(len(idx) if int(idx[-1]) == len(idx) - 1 else idx)
    return out


def install(model) -> None:
    """Make `model` (a native Qwen2 / Llama) run the fast forward for tree-session calls."""
    model.forward = FastForward(model)
