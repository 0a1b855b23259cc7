"""Tiny random Qwen2-architecture GGUF files, written with the `gguf` package, for the llama.cpp backend's tests.

What llama.cpp needs to load a Qwen2 GGUF, found by trying (llama.cpp 0c1e570, gguf 0.19):
- hyper-parameters under the `qwen2.` prefix: context length, embedding length, block count, feed-forward length,
  head counts, RMS-norm epsilon (rope base has a default but is written to match transformers);
- a "gpt2" (byte-level BPE) vocabulary: a token list, token types, merges (transformers' GGUF tokenizer converter
  needs them too) and an EOS id. 256 byte tokens make every string encodable and give llama.cpp the newline token
  it looks up at load time; one control token is the EOS;
- the tensors: token embedding, output norm (+ output head, optional in llama.cpp), and per block attn_norm,
  attn_q/k/v (+ biases, which Qwen2 has and transformers expects), attn_output, ffn_norm, ffn_gate/up/down.
  1-D tensors stay F32 whatever the weight type, as llama.cpp's converter writes them.

Shapes are given numpy-style (rows, cols): `token_embd.weight` is (vocab, hidden), a linear layer is (out, in).

The quantized dtypes the native backend runs ("q4_k", "q6_k", "q5_0", "mixed") are written as random blocks
(`tests/kernels/blocks.random_blocks`: `gguf.quants` cannot write K-quants), re-scaled so each matrix has the spread
the float weights of the same name have, so outputs stay as sharp as the f32 model's. K-quant rows hold 256 weights
a block: those models need `hidden` and `ffn` multiples of 256.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as QT
from gguf.quants import dequantize, quantize

from tests.kernels.blocks import random_blocks

HIDDEN, FFN, HEADS, KV_HEADS = 64, 128, 4, 2  # 64 and 128 are multiples of Q8_0's block of 32
MERGES = ["d e", "de f", "Ġ t", "r e"]


def byte_tokens() -> list[str]:
    """GPT-2's byte -> printable character table: byte b is token b."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAC + 1)) + list(range(0xAE, 0xFF + 1))
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


TOKENS = byte_tokens() + [m.replace(" ", "") for m in MERGES] + ["<|endoftext|>"]
VOCAB = len(TOKENS)  # 261
EOS = VOCAB - 1


def _shapes(layers: int, hidden: int, ffn: int, biases: bool, heads: int = HEADS,
            kv_heads: int = KV_HEADS) -> dict[str, tuple[int, ...]]:
    """Every tensor's (rows, cols) in file order; q/k/v biases only where the architecture has them (Qwen2)."""
    kv = kv_heads * hidden // heads
    shapes = {"token_embd.weight": (VOCAB, hidden)}
    for i in range(layers):
        b = f"blk.{i}."
        shapes.update({b + "attn_norm.weight": (hidden,), b + "attn_q.weight": (hidden, hidden)})
        if biases:
            shapes[b + "attn_q.bias"] = (hidden,)
        shapes[b + "attn_k.weight"] = (kv, hidden)
        if biases:
            shapes[b + "attn_k.bias"] = (kv,)
        shapes[b + "attn_v.weight"] = (kv, hidden)
        if biases:
            shapes[b + "attn_v.bias"] = (kv,)
        shapes.update({
            b + "attn_output.weight": (hidden, hidden), b + "ffn_norm.weight": (hidden,),
            b + "ffn_gate.weight": (ffn, hidden), b + "ffn_up.weight": (ffn, hidden),
            b + "ffn_down.weight": (hidden, ffn),
        })
    shapes.update({"output_norm.weight": (hidden,), "output.weight": (VOCAB, hidden)})
    return shapes


def _weights(seed: int, layers: int, noise: float, noise_seed: int, hidden: int = HIDDEN, ffn: int = FFN,
             biases: bool = True, heads: int = HEADS, kv_heads: int = KV_HEADS) -> dict[str, np.ndarray]:
    """Random weights scaled so activations stay O(1) and the output distribution is sharp (no greedy near-ties).
    `noise` > 0 adds Gaussian noise of that relative size: a draft that mostly agrees with the seed's model."""
    rng = np.random.default_rng(seed)
    out = {}
    for name, shape in _shapes(layers, hidden, ffn, biases, heads, kv_heads).items():
        if name.endswith("norm.weight"):
            w = 1.0 + 0.1 * rng.standard_normal(shape)
        elif name.endswith(".bias"):
            w = 0.1 * rng.standard_normal(shape)
        else:
            w = _spread(name, shape) * rng.standard_normal(shape)
        out[name] = w.astype(np.float32)
    if noise:
        noisy = np.random.default_rng(noise_seed)
        for name, w in out.items():
            out[name] = (w + noise * w.std() * noisy.standard_normal(w.shape)).astype(np.float32)
    return out


def _spread(name: str, shape: tuple[int, int]) -> float:
    """The standard deviation of a 2-D weight: O(1) embeddings, a sharp head, 1/sqrt(fan-in) linear layers."""
    if name == "token_embd.weight":
        return 1.0
    if name == "output.weight":
        return 0.6
    return float(1 / np.sqrt(shape[1]))


# ---------------------------------------------------------------------------------------- quantized weights

QUANT_DTYPES = ("q4_k", "q6_k", "q5_0", "mixed")
# byte offsets of each block's float16 scales (Q4_K: d then dmin; Q6_K: d last; Q5_0, Q8_0: d first)
_F16_SCALES = {QT.Q4_K: (0, 2), QT.Q6_K: (208,), QT.Q5_0: (0,), QT.Q8_0: (0,)}
# "mixed": a Q4_K_M-like spread of types; a row whose length is not a multiple of its type's block gets _FALLBACK
_MIXED = {"attn_v": QT.Q6_K, "attn_output": QT.Q5_0, "ffn_down": QT.Q6_K, "output": QT.Q6_K, "token_embd": QT.Q8_0}
_FALLBACK = QT.Q8_0


def weight_type(dtype: str, name: str, k: int) -> QT:
    """The GGUF type a 2-D tensor of row length `k` gets under quantized `dtype`."""
    if dtype == "mixed":
        kind = name.removesuffix(".weight").split(".")[-1]
        qtype = _MIXED.get(kind, QT.Q4_K)
    else:
        qtype = QT[dtype.upper()]
    return qtype if k % GGML_QUANT_SIZES[qtype][0] == 0 else _FALLBACK


def quant_blocks(qtype: QT, shape: tuple[int, int], rng: np.random.Generator, std: float) -> np.ndarray:
    """(rows, row_bytes) uint8: random blocks of `qtype` whose dequantized weights have standard deviation `std` and
    about zero mean. Q4_K's weights are d * scale * q - dmin * min with q in 0..15: dmin = 7.5 d centres them (the
    helper's dmin = d / 2 leaves the weights' mean about as large as their spread)."""
    n, k = shape
    blocks = random_blocks(qtype, n, k, rng)  # (n, row_bytes)
    per_block = blocks.reshape(-1, GGML_QUANT_SIZES[qtype][1])  # a view: (blocks, block_bytes)
    if qtype == QT.Q4_K:
        d = per_block[:, 0:2].copy().view(np.float16)
        per_block[:, 2:4] = (d * np.float16(7.5)).view(np.uint8)
    factor = std / float(dequantize(blocks, qtype).std())
    for at in _F16_SCALES[qtype]:
        scale = per_block[:, at:at + 2].copy().view(np.float16).astype(np.float32) * factor
        per_block[:, at:at + 2] = scale.astype(np.float16).view(np.uint8)
    return blocks


def _quant_weights(dtype: str, seed: int, layers: int, noise: float, noise_seed: int, hidden: int, ffn: int,
                   biases: bool, heads: int = HEADS, kv_heads: int = KV_HEADS) -> dict[str, tuple[np.ndarray, QT | None]]:
    """name -> (data, GGUF type or None for float32): 1-D tensors as `_weights` draws them, 2-D as random blocks.
    `noise` > 0 re-draws a noise² / 2 fraction of every matrix's blocks (from `noise_seed`): a re-drawn weight differs
    from the old by sqrt(2) of the spread, so the relative noise is `noise`, as for the float dtypes."""
    floats = _weights(seed, layers, noise, noise_seed, hidden, ffn, biases, heads, kv_heads)
    out = {}
    for i, (name, shape) in enumerate(_shapes(layers, hidden, ffn, biases, heads, kv_heads).items()):
        if len(shape) == 1:
            out[name] = (floats[name], None)
            continue
        qtype = weight_type(dtype, name, shape[1])
        std = _spread(name, shape)
        blocks = quant_blocks(qtype, shape, np.random.default_rng([seed, i]), std)
        if noise:
            noisy = np.random.default_rng([noise_seed, i])
            fresh = quant_blocks(qtype, shape, noisy, std)
            nbytes = GGML_QUANT_SIZES[qtype][1]
            flat, other = blocks.reshape(-1, nbytes), fresh.reshape(-1, nbytes)
            redraw = noisy.random(len(flat)) < noise**2 / 2
            flat[redraw] = other[redraw]
        out[name] = (blocks, qtype)
    return out


def write_tiny_gguf(path: Path | str, *, seed: int = 0, layers: int = 2, context: int = 256, dtype: str = "f32",
                    noise: float = 0.0, noise_seed: int = 1, skip: tuple[str, ...] = (), pooling: int | None = None,
                    arch: str = "qwen2", hidden: int = HIDDEN, ffn: int = FFN, tied: bool = False,
                    heads: int = HEADS, kv_heads: int = KV_HEADS, extra: dict | None = None) -> Path:
    """Write a tiny random Qwen2 GGUF to `path`; return the path.

    dtype: how 2-D weights are stored, "f32", "f16" or "q8_0" (quantized with gguf.quants), or one of QUANT_DTYPES
    (random blocks; "mixed" spreads Q4_K, Q6_K, Q5_0 and Q8_0 over the tensors, see `weight_type`). `skip`: tensor
    names left out (a broken file). `pooling`: write `<arch>.pooling_type` and non-causal attention, as an embedding
    model's GGUF carries. `arch`: the general.architecture written (hyper-parameter keys follow it); "llama" has no
    q/k/v biases. `hidden`, `ffn`: embedding and feed-forward widths. `tied`: no output.weight (the head is the
    token embedding, as in small Qwen2.5 models). `heads`, `kv_heads`: attention heads (head size hidden / heads).
    `extra`: more metadata, key -> (value, gguf.GGUFValueType).
    """
    import gguf

    path = Path(path)
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name("tiny-qwen2")
    writer.add_context_length(context)
    writer.add_embedding_length(hidden)
    writer.add_block_count(layers)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_freq_base(10000.0)
    if pooling is not None:
        writer.add_pooling_type(gguf.PoolingType(pooling))
        writer.add_causal_attention(False)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list(TOKENS)
    writer.add_token_types([gguf.TokenType.NORMAL] * (VOCAB - 1) + [gguf.TokenType.CONTROL])
    writer.add_token_merges(MERGES)
    writer.add_eos_token_id(EOS)
    writer.add_add_bos_token(False)
    for key, (value, kind) in (extra or {}).items():
        writer.add_key_value(key, value, kind)
    if tied:
        skip = (*skip, "output.weight")
    for name, (data, qtype) in _tensors(dtype, seed, layers, noise, noise_seed, hidden, ffn, arch != "llama", heads,
                                        kv_heads).items():
        if name in skip:
            continue
        if qtype is None:
            writer.add_tensor(name, data)
        else:
            writer.add_tensor(name, data, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _tensors(dtype: str, seed: int, layers: int, noise: float, noise_seed: int, hidden: int, ffn: int,
             biases: bool, heads: int = HEADS, kv_heads: int = KV_HEADS) -> dict[str, tuple[np.ndarray, QT | None]]:
    """name -> (data as written, GGUF type of raw block data, or None for a float32 array); 1-D tensors stay F32
    whatever the weight type, as llama.cpp's converter writes them."""
    if dtype in QUANT_DTYPES:
        return _quant_weights(dtype, seed, layers, noise, noise_seed, hidden, ffn, biases, heads, kv_heads)
    qtype = {"f32": QT.F32, "f16": QT.F16, "q8_0": QT.Q8_0}[dtype]
    out = {}
    for name, w in _weights(seed, layers, noise, noise_seed, hidden, ffn, biases, heads, kv_heads).items():
        if w.ndim == 1 or qtype == QT.F32:
            out[name] = (w, None)
        else:
            out[name] = (quantize(w, qtype), qtype)
    return out


def native_models(root: Path, files: dict[str, dict]):
    """`get(name)`: the tiny GGUF `write_tiny_gguf(**files[name])`, written under `root` and loaded on the native
    backend the first time it is asked for, the same loaded model afterwards (a module fixture's models)."""
    from arborspec.loading import load_model

    loaded = {}

    def get(name: str):
        if name not in loaded:
            path = write_tiny_gguf(Path(root) / f"{name}.gguf", **files[name])
            loaded[name] = load_model(str(path), backend="native", progress=False)
        return loaded[name]
    return get
