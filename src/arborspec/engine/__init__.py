"""The engine: the draft -> verify -> commit loop (decoder.py), and many prompts at once (batch.py)."""
from .decoder import GenerationResult, GenerationStats, SpeculativeDecoder, StepStats

__all__ = ["SpeculativeDecoder", "GenerationResult", "GenerationStats", "StepStats"]
