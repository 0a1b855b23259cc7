"""arborspec: tree-based speculative decoding for HuggingFace causal LMs.

    from arborspec import SpeculativeDecoder, load_pair

    target, draft = load_pair()  # the default Qwen pair, bf16, the draft variant measured fastest on this machine
    print(SpeculativeDecoder(target, draft).generate("def fib(n):").text)  # method "auto"

A method by name, as `arborspec generate --method` and `arborspec bench --methods` take it: arborspec.runspec.
"""
from .core.tree import DrawRule, TokenTree
from .engine import DecoderConfig, GenerationResult, SpeculativeDecoder
from .loading import load_model, load_pair

__version__ = "0.1.0"

__all__ = ["SpeculativeDecoder", "DecoderConfig", "GenerationResult", "TokenTree", "DrawRule", "load_model", "load_pair",
           "__version__"]
