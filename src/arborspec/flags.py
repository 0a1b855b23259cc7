"""Every argparse flag more than one command shares, declared once: the pair (--target, --draft, --dtype,
--draft-quant), the backends and llama.cpp's options, sampling, and the tree's layout. `generate`, `chat`,
`trees`, `calibrate`, `profile`, `bench` and `serve` take them from here (each the ones it needs), with the defaults
of loading/pair.py."""
from __future__ import annotations

import argparse

from .drafting import POLICIES
from .loading.model import BACKENDS
from .loading.pair import (
    DEFAULT_BACKEND,
    DEFAULT_DRAFT,
    DEFAULT_DRAFT_QUANT,
    DEFAULT_DTYPE,
    DEFAULT_TARGET,
    DRAFT_QUANTS,
)
from .runspec import DEFAULT_METHOD, GRAMMAR
from .verify import VERIFIERS


def add_pair_arguments(p: argparse.ArgumentParser, quant: bool = True) -> None:
    """--target, --draft, --dtype and --draft-quant, with the defaults above (`generate`, `chat`, `trees`, `bench`,
    `serve`; `calibrate` without --draft-quant: it measures the draft as loaded)."""
    p.add_argument("--target", default=DEFAULT_TARGET, help="target model: alias, local dir, .gguf file or hub id")
    p.add_argument("--draft", default=DEFAULT_DRAFT, help="draft model (same tokenizer as the target)")
    p.add_argument("--dtype", default=DEFAULT_DTYPE, help="bf16 (default: 2-3x faster than fp32 on CPU), fp32 or fp16")
    if not quant:
        return add_backend_arguments(p)
    p.add_argument("--draft-quant", default=DEFAULT_DRAFT_QUANT, choices=DRAFT_QUANTS,
                   help="the draft variant: int8 / int4 quantize a PyTorch draft's linear layers (int4 needs torchao); "
                        "q4_0 / iq4_nl requantize a GGUF draft on the native backend to a lean 4-bit file (once, "
                        "cached); none runs it as loaded; auto (default): the variant measured fastest for this pair "
                        "on this machine (cached; see `arborspec profile --pair`), for a native draft with its head "
                        "size too (unless --draft-vocab or +vocabK names one); a method's +int8 / +q4_0 / +noquant ... "
                        "lever overrides it")
    add_backend_arguments(p)


def add_backend_arguments(p: argparse.ArgumentParser) -> None:
    """--backend, --draft-backend and the --llama-* options (every command that loads models)."""
    p.add_argument("--backend", default=DEFAULT_BACKEND, choices=BACKENDS,
                   help="what runs the models: llamacpp (llama.cpp's quantized CPU kernels on the GGUF itself), torch "
                        "(transformers), native (transformers' layers over the GGUF's blocks on arborspec's own "
                        "kernels; docs/kernels.md), or auto (default): for an alias or .gguf, whichever of native "
                        "and llamacpp is measured fastest for it here (once, cached), else torch")
    p.add_argument("--draft-backend", default=None, choices=BACKENDS,
                   help="the draft's backend when it differs from --backend (e.g. a llama.cpp target with an int8 "
                        "PyTorch draft: --backend llamacpp --draft-backend torch)")
    p.add_argument("--llama-threads", type=int, default=None,
                   help="llama.cpp threads (default: every core this process may use)")
    p.add_argument("--llama-ctx", type=int, default=None,
                   help="llama.cpp context window in tokens (default: min(4096, the model's trained context))")
    p.add_argument("--llama-batch", type=int, default=None, help="llama.cpp tokens per decode call (default 512)")
    p.add_argument("--llama-seq", type=int, default=None,
                   help="llama.cpp sequence ids per context: one tree forward may hold this many minus one branches "
                        "(default 128, at most 256; each costs a row of logits in the context's buffer; auto's "
                        "cost profile forwards 64-leaf trees, so it needs 65)")


def add_sampling_arguments(p, draft: bool = True) -> None:
    """--temperature, --top-k, --top-p, --draft-temperature (unless not `draft`) and --seed (`generate`, `chat`,
    `trees`, `calibrate`; `serve`: the defaults for requests that leave the field out). `p`: a parser or an argument
    group."""
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=0, help="sample among the K most likely tokens only (0 = off)")
    p.add_argument("--top-p", type=float, default=1.0,
                   help="sample among the most likely tokens whose probabilities add up to P (1 = off)")
    if draft:
        p.add_argument("--draft-temperature", type=float, default=None,
                       help="the draft's own temperature (default: --temperature)")
    p.add_argument("--seed", type=int, default=None, help="seeds the sampling, for a repeatable run (default: random)")


def add_tree_layout_arguments(p) -> None:
    """--token-order and --ssm-tree: how a drafted tree is laid out for the target's forward (the output is the
    same either way)."""
    p.add_argument("--token-order", default="bfs", choices=["bfs", "dfs", "heavy"],
                   help="layout of the tree's tokens in the target's forward (DySpec App. C; same output)")
    p.add_argument("--ssm-tree", default="packed", choices=["packed", "unrolled"],
                   help="Mamba2/hybrid models (STree): one packed tree pass, or every path unrolled (the baseline)")


def add_method_arguments(p, example: str = "dynatree(adapt=false)@32+int8") -> None:
    """--method, --verifier and --allow-lossy (`generate`, `chat`, `trees`, `serve`; the bench takes a list:
    --methods)."""
    p.add_argument("--method", default=DEFAULT_METHOD,
                   help=f"{GRAMMAR}, e.g. {example} (default {DEFAULT_METHOD}; see docs/benchmarks.md); policies: "
                        f"{', '.join(POLICIES)}")
    p.add_argument("--verifier", default=None,
                   help=f"verification rule (default: the method's): {', '.join(VERIFIERS)}")
    p.add_argument("--allow-lossy", action="store_true",
                   help="permit a verifier that changes the output distribution (e.g. wetap-lossy)")
