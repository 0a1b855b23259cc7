"""Loading models: the PyPI-chunked aliases (aliases.py), one model on a backend (model.py), the backend plan
(plan.py, backend_choice.py), and THE pair loader every front end uses (pair.py)."""
from ..core.downloads import ModelLoadError
from .aliases import ALIASES
from .model import LoadedModel
from .pair import LoadedPair, load_pair
from .plan import load_model

__all__ = ["ALIASES", "LoadedModel", "LoadedPair", "ModelLoadError", "load_model", "load_pair"]
