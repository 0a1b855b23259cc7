"""What a generation reports (engine/stats.py), from hand-made steps: the per-step figures are over decoding steps,
the prompt's forward left out unless it is the only one."""
from __future__ import annotations

import pytest

from arborspec.engine.stats import GenerationStats, StepStats


def step(tree_size: int, accepted: int, committed: int, prefill: bool = False, t_draft: float = 0.0,
         t_verify: float = 0.0, root_optimum: float | None = None) -> StepStats:
    return StepStats(tree_size, depth=tree_size, widths=[1] * (tree_size + 1), accepted=accepted, committed=committed,
                     draft_calls=1, t_draft=t_draft, t_verify=t_verify, t_other=0.0, prefill=prefill,
                     root_optimum=root_optimum)


def test_per_step_figures_leave_the_prompts_forward_out_and_the_sums_keep_every_step():
    steps = [step(0, 0, 1, prefill=True), step(4, 2, 3, t_draft=0.25, t_verify=0.5, root_optimum=0.9),
             step(6, 0, 1, t_draft=0.75, t_verify=1.0, root_optimum=0.4)]
    stats = GenerationStats("static", "mbr", False, prompt_tokens=5, new_tokens=5, steps=steps)
    assert stats.decoding_steps == steps[1:] and stats.n_steps == 2
    assert stats.tokens_per_step == (3 + 1) / 2 and stats.mean_accepted == (2 + 0) / 2
    assert stats.root_acceptance == 1 / 2  # one of the two measured steps accepted a first drafted token
    out = stats.to_dict()
    assert out["mean_tree_size"] == (4 + 6) / 2 and out["t_draft"] == pytest.approx(1.0)
    assert out["t_verify"] == pytest.approx(1.5)
    alone = GenerationStats("static", "mbr", False, prompt_tokens=5, new_tokens=1, steps=steps[:1])
    assert alone.decoding_steps == steps[:1] and alone.n_steps == 1 and alone.tokens_per_step == 1.0
