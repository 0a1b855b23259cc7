"""arborspec: tree-based speculative decoding for HuggingFace causal LMs."""
from .engine import GenerationResult, SpeculativeDecoder
from .tree import DrawRule, TokenTree

__version__ = "0.1.0"


def load_model(spec: str, dtype=None, **kwargs):
    """Load a model and its tokenizer by alias, local directory, .gguf file or hub id (see arborspec.models.loading)."""
    from .models.loading import load_model as _load

    return _load(spec, dtype=dtype, **kwargs)


__all__ = ["SpeculativeDecoder", "GenerationResult", "TokenTree", "DrawRule", "load_model", "__version__"]
