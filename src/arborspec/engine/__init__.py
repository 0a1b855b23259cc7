"""The engine: the draft -> verify -> commit loop (decoder.py) and its settings (config.py), the verifier's choice
(verifier_choice.py), a generation's bookkeeping and records (generation.py, stats.py), many prompts at once
(many_prompts.py)."""
from .config import DecoderConfig
from .decoder import SpeculativeDecoder
from .stats import GenerationResult, GenerationStats, StepStats

__all__ = ["SpeculativeDecoder", "DecoderConfig", "GenerationResult", "GenerationStats", "StepStats"]
