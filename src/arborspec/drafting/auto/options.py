"""The auto policy's options (`--method auto --max-nodes 64 ...`, or `auto(guard=false)` in bench method names)."""
from __future__ import annotations

from dataclasses import dataclass

from ...core.options import check_int, opt, parse_bool
from ...core.tree import MAX_TREE_NODES


@dataclass
class AutoOptions:
    max_nodes: int = opt(128, "auto: at most this many drafted tokens per step (the profiled range)")
    max_layers: int = opt(16, "auto: at most this many drafted layers (tree depth)")
    max_children: int = opt(8, "auto: at most this many children per node")
    calibration: bool = opt(True, "auto: learn acceptance per draft score online (false: trust a(x) = x)")
    adapt_costs: bool = opt(True, "auto: rescale the profiled costs by measured step times")
    guard: bool = opt(True, "auto: fall back to plain decoding while speculation is measured slower")
    guard_margin: float = opt(0.1, "auto: fall back when measured tokens/s < (1 - margin) x plain decoding's")
    guard_window: int = opt(8, "auto: steps per guard comparison")
    guard_cooldown: int = opt(16, "auto: plain steps before speculation is probed again")
    reprofile: bool = opt(False, "auto: measure the cost profile again instead of using the cached one")
    remember: bool = opt(True, "auto: load and save the calibration in the cache directory")
    repeatable: bool = opt(False, "auto: trees from the cached profile and this run alone (adapt_costs, guard and "
                                  "remember off), so a seeded sampled run gives the same tokens every time")

    def __post_init__(self):
        for name in ("max_nodes", "max_layers", "max_children"):
            check_int(getattr(self, name), name, high=MAX_TREE_NODES)
        for name in ("guard_window", "guard_cooldown"):
            check_int(getattr(self, name), name)
        for name in ("calibration", "adapt_costs", "guard", "reprofile", "remember", "repeatable"):
            setattr(self, name, parse_bool(getattr(self, name), name))
        if self.repeatable:  # each of these reads the clock or earlier runs, and a tree's shape moves its random draws
            self.adapt_costs = self.guard = self.remember = False
        if not 0 <= self.guard_margin < 1:
            raise ValueError(f"guard_margin must be in [0, 1), got {self.guard_margin!r}")
