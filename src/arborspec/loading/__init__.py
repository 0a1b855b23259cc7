"""Loading models: the PyPI-chunked aliases (aliases.py), one model on a backend (model.py), the backend plan
(plan.py, backend_choice.py), and THE pair loader every front end uses (pair.py).

The names below are imported on first use (PEP 562): `arborspec models list` reads aliases.py without torch."""
from ..core.downloads import ModelLoadError
from ..core.lazy import lazy_exports

_EXPORTS = {"ALIASES": "aliases", "LoadedModel": "model", "LoadedPair": "pair", "load_pair": "pair",
            "load_model": "plan"}

__all__ = [*_EXPORTS, "ModelLoadError"]

__getattr__ = lazy_exports(__name__, _EXPORTS)
