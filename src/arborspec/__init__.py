"""arborspec: tree-based speculative decoding for HuggingFace causal LMs.

    from arborspec import SpeculativeDecoder, load_pair

    target, draft = load_pair()  # the default Qwen pair, on the backend and draft variant measured fastest here
    print(SpeculativeDecoder(target, draft).generate("def fib(n):").text)  # method "auto"

A method by name, as `arborspec generate --method` and `arborspec bench --methods` take it: arborspec.runspec.
"""
from .core.lazy import lazy_exports

__version__ = "0.1.0"

# public name -> the module that holds it; imported on first use (PEP 562), so `import arborspec` and the console
# script's `--help` do not pay for torch and transformers (4-5 s) before they need them
_EXPORTS = {"SpeculativeDecoder": "engine", "DecoderConfig": "engine", "GenerationResult": "engine",
            "TokenTree": "core.tree", "DrawRule": "core.tree", "load_model": "loading", "load_pair": "loading"}

__all__ = [*_EXPORTS, "__version__"]

__getattr__ = lazy_exports(__name__, _EXPORTS)
