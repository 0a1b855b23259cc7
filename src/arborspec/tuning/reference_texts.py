"""The fixed texts models are measured on (imports nothing: the cost and agreement measurements in tuning/costs.py read
them, and the modules that fetch larger corpora sit above tuning/costs.py).

`DEFAULT_PROMPTS` are short code prompts: `arborspec calibrate` generates from them (Sequoia's acceptance vector) and
`draft_choice` measures a draft's agreement with the target on them, with `REFERENCE_TEXT`.
"""
from __future__ import annotations

DEFAULT_PROMPTS = [
    'def quicksort(arr):\n    """Sort a list of numbers in ascending order using quicksort."""\n',
    "import json\n\n\ndef load_config(path):\n",
    "class Stack:\n    def __init__(self):\n",
    "def is_prime(n: int) -> bool:\n",
]
# a file of ordinary Python that neither model was shown by this project: teacher-forced agreement of a draft with
# its target is measured on it and DEFAULT_PROMPTS (tuning/draft_choice.py, agreement.pair_agreement)
REFERENCE_TEXT = '''from dataclasses import dataclass, field


@dataclass
class Inventory:
    """Items in stock, by name, with a running total of their value."""

    items: dict[str, int] = field(default_factory=dict)
    prices: dict[str, float] = field(default_factory=dict)

    def add(self, name: str, count: int, price: float) -> None:
        """Add `count` units of `name`; the latest price wins."""
        if count <= 0:
            raise ValueError("count must be positive")
        self.items[name] = self.items.get(name, 0) + count
        self.prices[name] = price

    def remove(self, name: str, count: int) -> int:
        """Remove up to `count` units and return how many were removed."""
        have = self.items.get(name, 0)
        taken = min(have, count)
        if taken == have:
            self.items.pop(name, None)
        else:
            self.items[name] = have - taken
        return taken

    def total_value(self) -> float:
        return sum(self.prices[name] * count for name, count in self.items.items())


def binary_search(values: list[int], target: int) -> int:
    """Return the index of target in the sorted list values, or -1 if it is absent."""
    lo, hi = 0, len(values) - 1
    while lo <= hi:
        mid = (lo + hi) // 2
        if values[mid] == target:
            return mid
        if values[mid] < target:
            lo = mid + 1
        else:
            hi = mid - 1
    return -1


def word_counts(text: str) -> dict[str, int]:
    """Count how often each word occurs in text, ignoring case and punctuation."""
    counts: dict[str, int] = {}
    for word in text.lower().split():
        word = word.strip(".,;:!?\\"'()")
        if word:
            counts[word] = counts.get(word, 0) + 1
    return counts
'''


def reference_texts() -> list[str]:
    return [REFERENCE_TEXT, *DEFAULT_PROMPTS]
