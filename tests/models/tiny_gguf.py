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
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

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


def _weights(seed: int, layers: int, noise: float, noise_seed: int) -> dict[str, np.ndarray]:
    """Random weights scaled so activations stay O(1) and the output distribution is sharp (no greedy near-ties).
    `noise` > 0 adds Gaussian noise of that relative size: a draft that mostly agrees with the seed's model."""
    rng = np.random.default_rng(seed)
    kv = KV_HEADS * HIDDEN // HEADS
    shapes = {"token_embd.weight": (VOCAB, HIDDEN)}
    for i in range(layers):
        b = f"blk.{i}."
        shapes.update({
            b + "attn_norm.weight": (HIDDEN,), b + "attn_q.weight": (HIDDEN, HIDDEN), b + "attn_q.bias": (HIDDEN,),
            b + "attn_k.weight": (kv, HIDDEN), b + "attn_k.bias": (kv,), b + "attn_v.weight": (kv, HIDDEN),
            b + "attn_v.bias": (kv,), b + "attn_output.weight": (HIDDEN, HIDDEN), b + "ffn_norm.weight": (HIDDEN,),
            b + "ffn_gate.weight": (FFN, HIDDEN), b + "ffn_up.weight": (FFN, HIDDEN),
            b + "ffn_down.weight": (HIDDEN, FFN),
        })
    shapes.update({"output_norm.weight": (HIDDEN,), "output.weight": (VOCAB, HIDDEN)})
    out = {}
    for name, shape in shapes.items():
        if name.endswith("norm.weight"):
            w = 1.0 + 0.1 * rng.standard_normal(shape)
        elif name.endswith(".bias"):
            w = 0.1 * rng.standard_normal(shape)
        elif name == "token_embd.weight":
            w = rng.standard_normal(shape)
        elif name == "output.weight":
            w = 0.6 * rng.standard_normal(shape)
        else:
            w = rng.standard_normal(shape) / np.sqrt(shape[1])
        out[name] = w.astype(np.float32)
    if noise:
        noisy = np.random.default_rng(noise_seed)
        for name, w in out.items():
            out[name] = (w + noise * w.std() * noisy.standard_normal(w.shape)).astype(np.float32)
    return out


def write_tiny_gguf(path: Path | str, *, seed: int = 0, layers: int = 2, context: int = 256, dtype: str = "f32",
                    noise: float = 0.0, noise_seed: int = 1, skip: tuple[str, ...] = (), pooling: int | None = None,
                    arch: str = "qwen2") -> Path:
    """Write a tiny random Qwen2 GGUF to `path`; return the path.

    dtype: how 2-D weights are stored, "f32", "f16" or "q8_0" (quantized with gguf.quants). `skip`: tensor names
    left out (a broken file). `pooling`: write `<arch>.pooling_type` and non-causal attention, as an embedding
    model's GGUF carries. `arch`: the general.architecture written (hyper-parameter keys follow it).
    """
    import gguf

    path = Path(path)
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name("tiny-qwen2")
    writer.add_context_length(context)
    writer.add_embedding_length(HIDDEN)
    writer.add_block_count(layers)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
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
    qtype = {"f32": gguf.GGMLQuantizationType.F32, "f16": gguf.GGMLQuantizationType.F16,
             "q8_0": gguf.GGMLQuantizationType.Q8_0}[dtype]
    for name, w in _weights(seed, layers, noise, noise_seed).items():
        if name in skip:
            continue
        if w.ndim == 1 or qtype == gguf.GGMLQuantizationType.F32:
            writer.add_tensor(name, w)
        else:
            writer.add_tensor(name, gguf.quants.quantize(w, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
