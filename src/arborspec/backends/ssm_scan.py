"""The math of STree (Wu et al.): Mamba2's selective SSM and short convolution over a packed token tree.

Pure functions on tensors, no model and no bookkeeping; `backends/ssm.py` runs them inside a real model.

Mamba2 (transformers' `Mamba2Mixer.torch_forward`, chunked path), per head h with scalar decay:

    dt_t = clamp(softplus(dt_raw_t + dt_bias), *time_step_limit)       A = -exp(A_log)
    state_t = exp(dt_t * A) * state_{t-1} + dt_t * (x_t outer B_t)       (x_t: head_dim, B_t: state_size)
    y_t = state_t . C_t + D * x_t

where (x, B, C) come out of a causal depthwise conv1d (kernel 4) + SiLU over the in_proj features, B and C are shared
by the heads of a group (head h uses group h // (heads / n_groups)), and y is gated by silu(z) inside a grouped
RMSNorm before out_proj. Unrolling the recurrence along a path gives Mamba2's quadratic (SSD) form; STree replaces
its causal mask by the tree's ancestor mask L (L[t, s] = 1 iff s is t or one of its ancestors):

    cum = L @ (dt * A)                                           (the paper's A_tree: log-decay summed along the path)
    y_t = exp(cum_t) * (C_t . state0) + sum_s L[t, s] exp(cum_t - cum_s) (C_t . B_s) dt_s x_s  + D * x_t

One pass, one initial state `state0`, no per-path unrolling. The short convolution is tree-aware too: a node mixes
itself with its ancestors (and, above the first row, with the committed tail kept in the conv state), never with the
previous *packed* positions, which in a tree belong to other branches.

Everything is batched over a leading dimension b: b = 1 for a packed tree, b = number of paths for the unrolled
baseline (one causal chain, and one state, per root-to-leaf path).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


# ---- the short convolution ---------------------------------------------------------------------------------------
def conv_taps(parent_rows: list[int], kernel: int, rows: list[int]) -> torch.Tensor:
    """(len(rows), kernel) indices of each row's conv inputs in the buffer [tail (kernel-1) | all rows].

    `parent_rows[r]` is row r's parent row, -1 for a row that directly follows the committed sequence. Tap kernel-1 is
    the row itself, tap kernel-1-m its m-th ancestor; ancestors above the first row continue into the committed tail
    (the conv state: the last kernel-1 inputs, oldest first; zeros for a fresh sequence, i.e. the causal padding).
    """
    k1 = kernel - 1
    out = torch.empty(len(rows), kernel, dtype=torch.long)
    for i, r in enumerate(rows):
        row, back = r, 0
        for m in range(kernel):
            if row >= 0:
                out[i, k1 - m] = k1 + row
                row = parent_rows[row]
            else:
                back += 1
                out[i, k1 - m] = k1 - back
    return out


def tree_conv(buf: torch.Tensor, taps: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """Depthwise conv along tree paths: out[b, t, c] = sum_j weight[c, j] * buf[b, taps[b, t, j], c] + bias[c].

    buf (b, L, C): [tail | rows] per sequence; taps (b, T, K); weight (C, K) (conv1d.weight[:, 0]); returns (b, T, C)
    in float32 (the causal conv1d is a cross-correlation: tap K-1 multiplies the current token).
    """
    b = buf.shape[0]
    gathered = buf[torch.arange(b)[:, None, None], taps]  # (b, T, K, C)
    out = (gathered.float() * weight.float().T).sum(dim=2)
    return out + bias.float() if bias is not None else out


def new_conv_tail(tail: torch.Tensor, raw: torch.Tensor) -> torch.Tensor:
    """The conv state after appending the rows `raw` (L, C) to a sequence whose conv state is `tail` (K-1, C)."""
    k1 = tail.shape[0]
    return torch.cat([tail, raw.to(tail.dtype)], dim=0)[-k1:] if k1 else tail


# ---- the selective scan -------------------------------------------------------------------------------------------
def discretize(dt_raw: torch.Tensor, dt_bias: torch.Tensor, A_log: torch.Tensor,
               limit: tuple[float, float] = (0.0, float("inf"))) -> tuple[torch.Tensor, torch.Tensor]:
    """(dt, dt * A) in float32, as transformers' chunked Mamba2 path: softplus(dt + dt_bias) clamped to `limit`."""
    dt = F.softplus(dt_raw.float() + dt_bias.float())
    dt = torch.clamp(dt, min=limit[0], max=limit[1])
    return dt, dt * -torch.exp(A_log.float())


def tree_ssd(C: torch.Tensor, cum_q: torch.Tensor, B: torch.Tensor, x: torch.Tensor, dt: torch.Tensor,
             cum_s: torch.Tensor, mask: torch.Tensor, state0: torch.Tensor) -> torch.Tensor:
    """The tree-masked SSD form (without the D skip), in float32.

    Queries t: C (b, T, G, N), cum_q (b, T, H) = log-decay summed from state0 down to t (inclusive).
    Sources s: B (b, S, G, N), x (b, S, H, P), dt (b, S, H), cum_s (b, S, H).
    mask (b or 1, T, S) bool: s is t or an ancestor of t. state0 (b, H, P, N): the state before the first row.
    Returns y (b, T, H, P).
    """
    H, G = x.shape[2], B.shape[2]
    rep = H // G
    C, B, x = C.float(), B.float(), x.float()
    seg = cum_q[:, :, None, :] - cum_s[:, None, :, :]  # (b, T, S, H)
    decay = seg.masked_fill(~mask[..., None], float("-inf")).exp()  # 0 off the ancestor set, never overflows
    CB = torch.einsum("btgn,bsgn->btsg", C, B).repeat_interleave(rep, dim=-1)  # (b, T, S, H)
    y = torch.einsum("btsh,bshp->bthp", CB * decay * dt[:, None], x)
    Ch = C.repeat_interleave(rep, dim=2)  # (b, T, H, N)
    y0 = torch.einsum("bthn,bhpn->bthp", Ch, state0.float())
    return y + y0 * cum_q.exp()[..., None]


def replay_state(state0: torch.Tensor, x: torch.Tensor, dt: torch.Tensor, dA: torch.Tensor,
                 B: torch.Tensor) -> torch.Tensor:
    """Activation replay: the SSM state after the chain of rows (x (L, H, P), dt, dA (L, H), B (L, G, N)).

    state_L = exp(sum dA) * state0 + sum_s exp(sum_{s<j<=L} dA_j) dt_s x_s outer B_s, from the activations the
    verified pass kept, so no per-node state was ever stored.
    """
    if x.shape[0] == 0:
        return state0
    H, G = x.shape[1], B.shape[1]
    cum = dA.cumsum(0)
    weight = (cum[-1:] - cum).exp() * dt  # (L, H)
    Bh = B.float().repeat_interleave(H // G, dim=1)  # (L, H, N)
    update = torch.einsum("lh,lhp,lhn->hpn", weight, x.float(), Bh)
    return state0 * cum[-1].exp()[:, None, None] + update


def chain_states(state0: torch.Tensor, x: torch.Tensor, dt: torch.Tensor, cum: torch.Tensor, B: torch.Tensor,
                 last: torch.Tensor) -> torch.Tensor:
    """The state of each sequence of a batch of chains after its row `last[b]` (later rows are padding).

    state0 (b, H, P, N); x (b, L, H, P); dt, cum (b, L, H); B (b, L, G, N); last (b,). Returns (b, H, P, N): what a
    state-carrying scan over each sequence (selective scan, chunk scan) ends with; the unrolled baseline keeps one.
    """
    b, L, H = dt.shape
    cum_last = cum[torch.arange(b), last]  # (b, H)
    valid = torch.arange(L)[None, :] <= last[:, None]  # (b, L)
    weight = ((cum_last[:, None] - cum).masked_fill(~valid[..., None], float("-inf"))).exp() * dt
    Bh = B.float().repeat_interleave(H // B.shape[2], dim=2)  # (b, L, H, N)
    update = torch.einsum("blh,blhp,blhn->bhpn", weight, x.float(), Bh)
    return state0.float() * cum_last.exp()[..., None, None] + update


def sequential_ssm(state0: torch.Tensor, x: torch.Tensor, dt: torch.Tensor, dA: torch.Tensor, B: torch.Tensor,
                   C: torch.Tensor, D: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The plain recurrence along one chain, token by token (the reference the tree scan is tested against).

    state0 (H, P, N); x (L, H, P); dt, dA (L, H); B, C (L, G, N); D (H). Returns (y (L, H, P), final state).
    """
    H, G = x.shape[1], B.shape[1]
    state, ys = state0.float(), []
    for t in range(x.shape[0]):
        Bh = B[t].float().repeat_interleave(H // G, dim=0)  # (H, N)
        Ch = C[t].float().repeat_interleave(H // G, dim=0)
        state = state * dA[t].exp()[:, None, None] + dt[t][:, None, None] * x[t].float()[:, :, None] * Bh[:, None, :]
        ys.append(torch.einsum("hpn,hn->hp", state, Ch) + D.float()[:, None] * x[t].float())
    return torch.stack(ys), state
