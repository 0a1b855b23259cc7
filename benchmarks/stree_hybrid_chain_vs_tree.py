"""The shape of STree's Table 2 on a synthetic Mamba2/attention hybrid: a chain (vanilla speculative decoding) against
a static tree verified with STree's tree scan, at T = 0 and T = 1.

STree drafts a 4-token chain (verified with speculative sampling) against a 4-layer x 3-token static tree (Fig. 4a)
on MambaInLlama-8B, a 50% Mamba2/attention hybrid. No hybrid model with a matching draft ships on PyPI, so this
builds one: a random 8-layer Bamba (every other layer attention, 50% like the paper's) with peaked output logits,
and as draft a noisy copy of it (same weights plus Gaussian noise), so the draft agrees with the target often but
not always. Both are saved as local model directories with a small character tokenizer and benchmarked with
`arborspec bench` (ar, chain@4 with SpS, the 3,3,3,3 static tree), so every number comes from the real engine and
the hybrid's real tree scan.

What transfers: tokens per step (tau) of chain vs tree, and how the hybrid's cost for 5 vs 13 tokens turns tau
into speed. What does not: absolute speed-ups, because the synthetic draft is as large as its target (the paper's
draft is a 2-layer model).

    python benchmarks/stree_hybrid_chain_vs_tree.py --threads 1 --out results/stree-hybrid   # ~8 min on 1 thread
"""
from __future__ import annotations

import argparse
import copy
import random
import string
import sys
import tempfile
from pathlib import Path

import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import AutoModelForCausalLM, BambaConfig, PreTrainedTokenizerFast

from arborspec.bench.report import write_report
from arborspec.bench.runner import BenchSettings, run_bench
from arborspec.console import run_command
from arborspec.loading import load_model

CHARS = string.ascii_lowercase + string.digits + " .,:;()[]=+-*/_\n"


def char_tokenizer() -> PreTrainedTokenizerFast:
    vocab = {"<eos>": 0, **{c: i + 1 for i, c in enumerate(CHARS)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<eos>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", unk_token="<eos>")


def hybrid(vocab: int, seed: int, hidden: int, layers: int) -> torch.nn.Module:
    """A random Bamba, attention in every other layer, with random decays and step sizes and peaked logits."""
    torch.manual_seed(seed)
    cfg = BambaConfig(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers, intermediate_size=2 * hidden,
                      num_attention_heads=8, num_key_value_heads=4, attn_layer_indices=list(range(1, layers, 2)),
                      mamba_n_heads=hidden // 32, mamba_d_head=64, mamba_d_state=64, mamba_n_groups=1,
                      mamba_expand=2, max_position_embeddings=4096, pad_token_id=None, eos_token_id=0,
                      bos_token_id=None, tie_word_embeddings=False)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, attn_implementation="sdpa")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("dt_bias"):
                p.copy_(torch.randn_like(p))
            elif name.endswith("A_log"):
                p.copy_(0.5 * torch.randn_like(p))
        model.get_output_embeddings().weight.mul_(6.0)
    return model.eval()


def noisy_copy(model, noise: float, seed: int):
    torch.manual_seed(seed)
    draft = copy.deepcopy(model)
    with torch.no_grad():
        for p in draft.parameters():
            if p.numel() > 1:
                p.add_(noise * p.std() * torch.randn_like(p))
    return draft


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="results/stree-hybrid")
    ap.add_argument("--prompts", type=int, default=20)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--noise", type=float, default=0.05, help="draft = target weights + noise * std * N(0, 1)")
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args(argv)
    tok = char_tokenizer()
    rng = random.Random(0)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        target = hybrid(len(CHARS) + 1, 0, args.hidden, args.layers)
        for name, model in (("target", target), ("draft", noisy_copy(target, args.noise, 1))):
            model.save_pretrained(root / name)
            tok.save_pretrained(root / name)
        prompts = root / "prompts.jsonl"
        with prompts.open("w") as fh:
            for i in range(args.prompts):
                text = "".join(rng.choice(CHARS[:36]) for _ in range(rng.randrange(16, 48)))
                fh.write(f'{{"id": "rand{i}", "prompt": "{text}"}}\n')
        settings = BenchSettings(
            target="synthetic 8-layer Bamba (50% attention)", draft=f"noisy copy (noise {args.noise})", dtype="fp32",
            datasets=[], prompt_file=str(prompts), methods=["ar", "sps@4", "static(widths=3,3,3,3)"],
            temperatures=[0.0, 1.0], prompts=args.prompts, max_new_tokens=args.max_new_tokens, ignore_eos=True,
            perplexity=False, threads=args.threads, out=args.out, draft_quant="none",
            command="python benchmarks/stree_hybrid_chain_vs_tree.py " + " ".join(sys.argv[1:] if argv is None else argv))
        pair = (load_model(str(root / "target"), dtype="fp32"), load_model(str(root / "draft"), dtype="fp32"))
        path = run_bench(settings, models=pair)
    for f in write_report(path.parent):
        print(f)
    return 0


if __name__ == "__main__":
    sys.exit(run_command(lambda _: main(), None))  # a bad value: one line and exit 2, as arborspec's own commands
