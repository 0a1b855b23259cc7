"""Verifiers inside the engine: greedy equivalence at temperature 0, which verifier fits which tree, seeds."""
import random

import pytest

from arborspec import SpeculativeDecoder
from arborspec.verify import VERIFIERS
from tests.conftest import noisy_copy, tiny_model

CHAIN_SHAPES = [("chain", {"k": 4}), ("static", {"depth": 3, "branch": 1})]
TREE_SHAPES = [("static", {"depth": 3, "branch": 2}), ("static", {"widths": "4,3,2"})]


def shapes(name):
    return CHAIN_SHAPES + ([] if VERIFIERS[name].chain_only else TREE_SHAPES)


@pytest.fixture(scope="module", params=["llama", "gpt2"])
def pair(request):
    target = tiny_model(request.param, seed=3)
    return target, noisy_copy(target, noise=0.3)


@pytest.mark.parametrize("name", sorted(VERIFIERS))
def test_every_verifier_is_greedy_at_temperature_zero(pair, name):
    target, draft = pair
    rng = random.Random(2)
    prompts = [[rng.randrange(2, 56) for _ in range(rng.randrange(1, 8))] for _ in range(3)]
    for method, options in shapes(name):
        accepted = 0
        for prompt in prompts:
            ref = SpeculativeDecoder(target, method="ar").generate(prompt, max_new_tokens=16, ignore_eos=True)
            dec = SpeculativeDecoder(target, draft, method=method, verifier=name, allow_lossy=True, **options)
            res = dec.generate(prompt, max_new_tokens=16, ignore_eos=True, seed=0)
            assert res.token_ids == ref.token_ids, (name, method, options)
            accepted += sum(s.accepted for s in res.stats.steps)
        assert accepted > 0


@pytest.fixture(scope="module")
def models():
    target = tiny_model("llama", seed=0)
    return target, noisy_copy(target, 0.5)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        # chain-only verifiers on branching trees
        (dict(method="static", depth=2, branch=2, verifier="sps"), r"chains only.*exact alternatives: mbr, naive, traversal$"),
        (dict(method="static", depth=2, branch=2, verifier="asps"), r"chains only.*alternatives: mbr, naive, traversal$"),
        (dict(method="static", depth=2, branch=2, verifier="block"), r"chains only.*alternatives: mbr, naive, traversal$"),
        (dict(method="static", widths="1,1", verifier="sps"), r"chains only.*exact alternatives: naive$"),
        (dict(method="static", depth=2, branch=2, verifier="sps", temperature=0.0),
         r"chains only.*exact alternatives: greedy, greedy-draft, mbr, mss, naive, traversal$"),
        # multi-draft rules on the wrong drawing rule
        (dict(method="static", depth=2, branch=2, verifier="mss"),
         r"drawn without_replacement.*alternatives: mbr, naive, traversal$"),
        (dict(method="static", depth=2, branch=2, verifier="greedy-draft"),
         r"drawn without_replacement.*alternatives: mbr, naive, traversal$"),
        (dict(method="static", widths="3,2", verifier="traversal"), r"drawn deterministic.*alternatives: naive$"),
        # greedy multi-draft trees (k-1 top tokens + one draw) have one exact verifier besides naive
        *[(dict(method="static", depth=2, branch=2, draw="greedy", verifier=v),
           r"drawn greedy_topk_plus_one.*exact alternatives: greedy-draft, naive$") for v in ("mbr", "mss", "traversal")],
        (dict(method="sequoia", budget=8, draw="greedy", verifier="mbr"),
         r"drawn greedy_topk_plus_one.*exact alternatives: greedy-draft, naive$"),
        (dict(method="static", depth=2, branch=2, draw="greedy", verifier="sps"),
         r"chains only.*exact alternatives: greedy-draft, naive$"),
        (dict(method="static", depth=2, branch=2, draw="iid", verifier="mbr"),
         r"drawn with_replacement.*exact alternatives: mss, naive, traversal$"),
        (dict(method="static", widths="3,2", verifier="mbr"), r"drawn deterministic.*alternatives: naive$"),
        # a greedy draft under sampling draws deterministically: speculative sampling would not be exact
        (dict(method="chain", k=3, verifier="sps", draft_temperature=0.0), r"deterministic.*alternatives: naive$"),
        # lossy
        (dict(method="static", verifier="wetap"), "does not preserve the target distribution"),
        # nodes no draft model drew have no draft distribution: refused at T = 0 too, where they were accepted and
        # failed mid-generation; and for the lossy wetap, which reads the draft's distributions at any temperature
        *[(dict(method="static", depth=2, branch=2, verifier=v, ngram=3, temperature=0.0),
           r"nodes no draft model drew .* exact alternatives: greedy, naive, or drop the branches")
          for v in ("mbr", "traversal", "mss", "greedy-draft")],
        (dict(method="suffix", verifier="mbr", temperature=0.0), r"method 'suffix'.* alternatives: greedy, naive$"),
        # auto's default suffix branches go onto every tree at T = 0 (onto bare trees only at T > 0, verified by naive)
        (dict(method="auto", verifier="mbr", temperature=0.0),
         r"method 'auto'.* exact alternatives: greedy, naive, or drop the branches"),
        # a chain with branches is a tree, and what a chain-only rule is told to use instead must read no draft rows
        (dict(method="chain", k=3, verifier="sps", ngram=3, temperature=0.0),
         r"chains only.*exact alternatives: greedy, naive$"),
        (dict(method="wetap", budget=8, verifier="wetap", allow_lossy=True, lookahead=4),
         r"nodes no draft model drew.*exact alternatives: naive, or drop"),
    ],
)
def test_unfit_verifiers_are_refused(models, kwargs, match):
    target, draft = models
    kwargs = {"temperature": 0.8, **kwargs}
    with pytest.raises(ValueError, match=match):
        SpeculativeDecoder(target, draft, **kwargs)


@pytest.mark.parametrize(
    "method,options,verifiers",
    [
        # a chain's single child fits every multi-draft rule
        ("chain", {"k": 3}, ["sps", "asps", "block", "mss", "mbr", "traversal", "greedy-draft", "naive"]),
        ("static", {"depth": 3, "branch": 1}, ["sps", "asps", "block", "mss", "mbr", "traversal", "greedy-draft", "naive"]),
        ("static", {"depth": 2, "branch": 3}, ["mbr", "traversal", "naive"]),
        ("static", {"widths": "3,2"}, ["naive"]),
        ("static", {"depth": 2, "branch": 3, "draw": "greedy"}, ["greedy-draft", "naive"]),
        ("static", {"depth": 2, "branch": 3, "draw": "iid"}, ["mss", "traversal", "naive"]),
        ("static", {"depth": 3, "branch": 1, "draw": "greedy"}, ["sps", "asps", "block", "mbr", "greedy-draft"]),
    ],
)
def test_fitting_verifiers_are_accepted_and_run(models, method, options, verifiers):
    target, draft = models
    for name in verifiers:
        dec = SpeculativeDecoder(target, draft, method=method, temperature=0.8, top_k=20, verifier=name, **options)
        res = dec.generate([4, 9, 12], max_new_tokens=12, ignore_eos=True, seed=1)
        assert len(res.token_ids) == 12 and res.stats.verifier == name and not res.stats.lossy


@pytest.mark.parametrize(
    "method,options,temperature,draft_temperature,expected",
    [
        ("chain", {"k": 3}, 0.8, None, "sps"),
        ("chain", {"k": 3}, 0.0, None, "greedy"),
        ("static", {"depth": 2, "branch": 2}, 0.8, None, "mbr"),
        ("static", {"widths": "3,2"}, 0.8, None, "naive"),
        ("static", {"depth": 2, "branch": 2, "draw": "greedy"}, 0.8, None, "greedy-draft"),
        ("static", {"depth": 2, "branch": 2, "draw": "iid"}, 0.8, None, "mss"),
        ("static", {"depth": 2, "branch": 2, "draw": "greedy"}, 0.8, 0.0, "naive"),  # a greedy draft: top-k children
        ("chain", {"k": 3}, 0.8, 0.0, "naive"),  # greedy draft under sampling: deterministic children
        ("static", {"depth": 2, "branch": 2}, 0.8, 0.0, "naive"),
        ("chain", {"k": 3}, 0.8, 1.2, "sps"),  # a different draft temperature still samples
    ],
)
def test_default_verifiers(models, method, options, temperature, draft_temperature, expected):
    target, draft = models
    dec = SpeculativeDecoder(target, draft, method=method, temperature=temperature,
                             draft_temperature=draft_temperature, **options)
    assert dec.verifier.name == expected


def test_wetap_with_allow_lossy_is_flagged(models):
    target, draft = models
    dec = SpeculativeDecoder(target, draft, method="static", temperature=0.8, verifier="wetap", allow_lossy=True)
    res = dec.generate([4, 9, 12], max_new_tokens=10, ignore_eos=True, seed=0)
    assert res.stats.lossy and res.stats.verifier == "wetap" and len(res.token_ids) == 10
    exact = SpeculativeDecoder(target, draft, method="static", temperature=0.8)
    assert not exact.generate([4, 9, 12], max_new_tokens=4, ignore_eos=True, seed=0).stats.lossy
    # nothing lossy ran: at T = 0 wetap's rule accepts the greedy path; `ar` verifies no tree
    for method, temperature in (("static", 0.0), ("ar", 0.8)):
        dec = SpeculativeDecoder(target, draft, method=method, temperature=temperature, verifier="wetap",
                                 allow_lossy=True)
        assert not dec.generate([4, 9, 12], max_new_tokens=4, ignore_eos=True, seed=0).stats.lossy


def test_a_plain_policy_takes_any_exact_verifier(models):
    """`ar` drafts no tree, so no verifier can lose exactness on one: sps, asps, block were refused for "trees with
    several children per node", mbr for children "drawn deterministic". With free branches the trees are checked."""
    target, draft = models
    for temperature in (0.0, 0.8):
        for name in ("sps", "asps", "block", "mbr"):
            assert SpeculativeDecoder(target, method="ar", temperature=temperature, verifier=name).verifier.name == name
    with pytest.raises(ValueError, match="not exact for trees"):
        SpeculativeDecoder(target, method="ar", temperature=0.8, verifier="sps", ngram=2)


@pytest.mark.parametrize("method,options,verifier", [("chain", {"k": 4}, "asps"), ("static", {"depth": 2, "branch": 2}, "mbr"),
                                                     ("static", {"widths": "3,2"}, "naive")])
def test_seeds_are_reproducible(models, method, options, verifier):
    target, draft = models
    dec = SpeculativeDecoder(target, draft, method=method, temperature=1.0, top_p=0.95, verifier=verifier, **options)
    run = lambda seed: dec.generate([4, 9, 12], max_new_tokens=30, ignore_eos=True, seed=seed).token_ids  # noqa: E731
    first = run(11)
    assert run(11) == first
    assert run(12) != first
    import torch

    torch.manual_seed(5)
    a = run(None)
    torch.manual_seed(5)
    assert run(None) == a  # None: the global generator
