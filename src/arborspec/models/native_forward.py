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
        if lin.matrix.qtype == last.qtype and lin.matrix.packed == last.packed:
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
    return type(group[0])(whole, bias)  # a QuantLinear (models/native.py imports this module: no import back)


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
    """Replaces `model.forward` (see the module docstring); `fallback` is transformers' forward."""

    def __init__(self, model):
        self.model = model
        self.fallback = model.forward
        self.layers = [Layer(layer, model.config) for layer in model.model.layers]
        self.embed, self.norm, self.head = model.model.embed_tokens, model.model.norm, model.lm_head
        self.rotary = model.model.rotary_emb
        self.dim = model.config.hidden_size

    def __call__(self, input_ids=None, position_ids=None, attention_mask=None, past_key_values=None, use_cache=True,
                 logits_to_keep=None, **extra):
        fits = (input_ids is not None and position_ids is not None and past_key_values is not None and not extra
                and isinstance(attention_mask, torch.Tensor) and attention_mask.dim() == 4 and input_ids.shape[0] == 1
                and isinstance(logits_to_keep, torch.Tensor))
        if not fits:
            return self.fallback(input_ids=input_ids, position_ids=position_ids, attention_mask=attention_mask,
                                 past_key_values=past_key_values, use_cache=use_cache, logits_to_keep=logits_to_keep,
                                 **extra)
        with torch.inference_mode():
            return SimpleNamespace(logits=self.forward(input_ids, position_ids, attention_mask, past_key_values,
                                                       logits_to_keep))

    def forward(self, ids, positions, mask, cache, keep) -> torch.Tensor:
        """ids, positions (1, q); mask (1, 1, q, past + q) additive; keep: row indices -> logits (1, len(keep), V)."""
        h = self.embed(ids)[0]  # (q, hidden)
        cos, sin = self.rotary(h[None], positions)  # (1, q, head_dim) each
        cos, sin = cos[:, None], sin[:, None]  # (1, 1, q, head_dim)
        seen = visible_keys(mask)
        for index, layer in enumerate(self.layers):
            h = h + self.attention(layer, index, F.rms_norm(h, (self.dim,), layer.norm1, layer.eps), cos, sin, seen,
                                   cache)
            h = h + layer.mlp(F.rms_norm(h, (self.dim,), layer.norm2, layer.eps))
        h = F.rms_norm(h[keep], (self.dim,), self.norm.weight, self.norm.variance_epsilon)
        return self.head(h)[None]  # (1, keep, vocab)

    @staticmethod
    def attention(layer: Layer, index: int, x, cos, sin, seen, cache) -> torch.Tensor:
        """x (q, hidden) -> (q, hidden): tree attention over the cache plus these tokens; row i sees keys seen[i].

        Each row attends on its own, to exactly the keys it may see, in cache order: the same call, on the same
        numbers, as when that token is decoded alone after its path was committed. So a token's logits do not
        depend on which other nodes share its forward, and greedy speculation reproduces plain greedy decoding
        token for token (a masked batch would round differently, and 8-bit activations turn such rounding into
        ~1% logit differences at quantization-step boundaries; docs/kernels.md)."""
        q_len, d = x.shape[0], layer.head_dim
        qkv = layer.project_qkv(x)  # (q, (H + 2 KV) d)
        q, k, v = qkv.split([layer.heads * d, layer.kv_heads * d, layer.kv_heads * d], dim=-1)
        q = rotate(q.view(q_len, layer.heads, d).transpose(0, 1)[None], cos, sin)  # (1, H, q, d)
        k = rotate(k.view(q_len, layer.kv_heads, d).transpose(0, 1)[None], cos, sin)  # (1, KV, q, d)
        v = v.reshape(q_len, layer.kv_heads, d).transpose(0, 1)[None]
        keys, values = cache.update(k, v, index)  # (1, KV, past + q, d)
        rows = []
        for i, idx in enumerate(seen):
            if isinstance(idx, int):  # the first idx keys: a view, no copy
                kk, vv = keys[:, :, :idx], values[:, :, :idx]
            else:
                kk, vv = keys.index_select(2, idx), values.index_select(2, idx)
            rows.append(F.scaled_dot_product_attention(q[:, :, i:i + 1], kk, vv, enable_gqa=True))  # (1, H, 1, d)
        out = torch.cat(rows, dim=2) if len(rows) > 1 else rows[0]  # (1, H, q, d)
        return layer.o(out[0].transpose(0, 1).reshape(q_len, layer.heads * d))


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
