"""Statistical proof that every exact verifier, on trees drawn by every rule it covers, emits the target's distribution.

Setup: a tiny random llama with an 8-token vocabulary as the target, a noisy copy as the draft, and a fixed prompt.
Their next-token logits for every continuation of up to 3 tokens are tabulated once (`harness.TableModel`), and the
real policies and verifiers run on those tables. We count the first k = 2 generated tokens (64 outcomes) while the
trees reach up to 3 tokens deep (horizon 4), and compare with the exact distribution under the same warp.

Each comparison is a chi-square test at level 1e-3 with enough samples that *any* distribution 0.02 away in total
variation would fail it with probability >= 0.95 (`harness.assert_same_distribution` checks both). The same test fails
deliberately wrong verifiers (including a block, a traversal and a greedy multi-draft verifier that skip their
residual correction; 0.075-0.48 TV off, so they are tried with the samples of a 0.05-TV test), and measures how far
the lossy WETAP rule drifts. The sampled tests are marked `slow`
(each ~15-60 CPU-seconds; `-m "not slow"` skips them).
"""
import pytest
import torch

from arborspec import SpeculativeDecoder
from arborspec.core.sampling import SamplingConfig
from arborspec.core.tree import DrawRule
from arborspec.drafting import POLICIES
from arborspec.verify import VERIFIERS
from arborspec.verify.base import Verdict, chain_nodes, draft_dist, draw, multi_draft_walk, target_probs
from arborspec.verify.block import BlockVerifier
from arborspec.verify.greedy_draft import GreedyDraftVerifier
from arborspec.verify.rules import (
    accept_prob,
    asps_neighbor,
    block_neighbor,
    block_plan,
    expected_tokens,
    reject_below,
    sps_neighbor,
    weight_step,
)
from arborspec.verify.sps import SpSVerifier
from arborspec.verify.traversal import TraversalVerifier
from tests.conftest import noisy_copy, tiny_model
from tests.verify.harness import (
    GreedyDraftTreePolicy,
    IIDTreePolicy,
    TableDecoder,
    TableModel,
    assert_same_distribution,
    exact_target_distribution,
    goodness_of_fit,
    plan_samples,
    sample_outputs,
    sampling_mode,
)
from tests.verify.test_greedy_draft import residual_free_plan

VOCAB, PROMPT, K, HORIZON = 8, [2, 5, 3, 7], 2, 4
SETTINGS = {
    "T1": dict(temperature=1.0),
    "T0.7,k4": dict(temperature=0.7, top_k=4),
    "p0.8": dict(temperature=1.0, top_p=0.8),
    "T1.3,k5,p0.9,dT0.8": dict(temperature=1.3, top_k=5, top_p=0.9, draft_temperature=0.8),
}


@pytest.fixture(scope="module")
def models():
    target = tiny_model("llama", seed=0, vocab=VOCAB)
    return target, noisy_copy(target, noise=1.0)


@pytest.fixture(scope="module")
def tables(models):
    target, draft = models
    return TableModel.from_model(target, PROMPT, HORIZON - 1), TableModel.from_model(draft, PROMPT, HORIZON - 1)


def run(tables, method, verifier, setting, seed, n=None, tv=0.02, **options):
    """Counts of the first K tokens over enough runs for a `tv` test (or n runs), and the exact target."""
    target, draft = tables
    dec = TableDecoder(target, draft, method, verifier, horizon=HORIZON, **SETTINGS[setting], **options)
    probs = exact_target_distribution(target, PROMPT, K, dec.sampling)
    counts = sample_outputs(dec, PROMPT, K, n or plan_samples(probs, tv=tv), seed)
    return counts, probs


# (verifier, drafting, setting): every exact verifier with every drawing rule it covers, across the warps. Sampled
# multi-child trees are drawn by the library's own schemes (static's `draw` option); the test-only policies
# (harness.IIDTreePolicy, GreedyDraftTreePolicy) serve the wrong verifiers below. Each case is 15-60 CPU-seconds, so
# a (verifier, drawing rule) pair is tried at one or two warps, not at all four.
EXACT = [
    ("sps", ("chain", dict(k=3)), "T1"),
    ("sps", ("chain", dict(k=3)), "T1.3,k5,p0.9,dT0.8"),
    ("asps", ("chain", dict(k=3)), "p0.8"),
    ("asps", ("static", dict(depth=3, branch=1)), "T1.3,k5,p0.9,dT0.8"),
    ("mss", ("static", dict(depth=2, branch=3, draw="iid")), "p0.8"),  # with replacement, duplicates common
    ("mss", ("chain", dict(k=3)), "T0.7,k4"),  # a chain's single child counts as drawn with replacement
    ("mbr", ("static", dict(depth=3, branch=2)), "p0.8"),  # without replacement
    ("mbr", ("static", dict(depth=2, branch=4)), "T0.7,k4"),  # branch = support: the draft runs out
    ("naive", ("static", dict(widths="3,2,2")), "p0.8"),  # deterministic
    ("naive", ("static", dict(depth=2, branch=2, draw="iid")), "T1.3,k5,p0.9,dT0.8"),
    ("block", ("chain", dict(k=3)), "T1.3,k5,p0.9,dT0.8"),
    ("traversal", ("static", dict(depth=2, branch=3, draw="iid")), "T0.7,k4"),  # with replacement (the paper's)
    ("traversal", ("static", dict(depth=3, branch=2)), "p0.8"),  # without replacement (our variant)
    ("greedy-draft", ("static", dict(depth=3, branch=2, draw="greedy")), "T1.3,k5,p0.9,dT0.8"),  # top-1 + a sample
    ("greedy-draft", ("static", dict(depth=2, branch=4, draw="greedy")), "T0.7,k4"),  # branch = support: no draw left
]


TEST_POLICIES = {"iid": IIDTreePolicy, "greedy_draft": GreedyDraftTreePolicy}


def policy(drafting):
    method, options = drafting
    return (TEST_POLICIES[method](**options), {}) if method in TEST_POLICIES else (method, options)


def test_every_exact_verifier_is_tried_on_every_drawing_rule_it_reads():
    """EXACT covers each sampling verifier (a new one is a file and a registry line: this asks for its case too), and
    each drawing rule a multi-child verifier that reads the draft's distribution declares it is exact for."""
    sampling = SamplingConfig(1.0)
    tried: dict[str, set] = {}
    for verifier, drafting, _ in EXACT:
        method, options = policy(drafting)
        tree_policy = POLICIES[method](**options) if isinstance(method, str) else method
        tried.setdefault(verifier, set()).update(tree_policy.draw_rules(sampling))
    for name, cls in VERIFIERS.items():
        if not cls.exact or name == "greedy":  # greedy: T = 0 only (tests/verify/test_engine_verifiers.py)
            continue
        assert name in tried, f"no chi-square case for the exact verifier {name}"
        if cls.reads_draft and not cls.chain_only:
            missing = set(cls.accepts) - {DrawRule.DETERMINISTIC} - tried[name]
            assert not missing, f"{name} is never tried on trees drawn {', '.join(r.name for r in missing)}"


@pytest.mark.slow
@pytest.mark.parametrize("verifier,drafting,setting", EXACT, ids=lambda x: x if isinstance(x, str) else None)
def test_exact_verifier_preserves_target_distribution(tables, verifier, drafting, setting, record_property):
    method, options = policy(drafting)
    counts, probs = run(tables, method, verifier, setting, seed=1234, **options)
    rep = assert_same_distribution(counts, probs, tv=0.02)
    record_property("fit", rep.__dict__)
    print(f"\n{verifier} on {drafting[0]} {setting}: n={rep.n} cells={rep.cells} p={rep.p_value:.3f} "
          f"TV={rep.empirical_tv:.4f} power(TV 0.02)={rep.power:.3f}")


# ---- the same test has teeth -----------------------------------------------------------------------------------------
class ForgetfulSpS(SpSVerifier):
    """SpS that forgets the residual: after a rejection it resamples from p instead of norm(max(p - q, 0))."""

    name = "forgetful_sps"

    def verify(self, tree, target_logits, sampling, generator):
        p = target_probs(target_logits, sampling)
        nodes, path = chain_nodes(tree, self.name), []
        for parent, child in zip(nodes, nodes[1:]):
            y = tree.tokens[child]
            if float(torch.rand((), generator=generator, dtype=torch.float64)) >= accept_prob(
                    float(p[parent, y]), float(draft_dist(tree, parent, self.name)[y])):
                return Verdict(path, draw(p[parent], generator))
            path.append(child)
        return Verdict(path, draw(p[nodes[len(path)]], generator))


class ResidualFreeBlock(BlockVerifier):
    """Block verification that skips the residual correction: after a partial acceptance the bonus comes from p."""

    name = "residual_free_block"

    def verify(self, tree, target_logits, sampling, generator):
        p = target_probs(target_logits, sampling)
        nodes = chain_nodes(tree, self.name)
        tokens = [tree.tokens[c] for c in nodes[1:]]
        q = torch.stack([draft_dist(tree, node, self.name) for node in nodes[:-1]])
        stop = block_plan(tokens, q, p[nodes[:-1]]).stop
        kept = next(i for i in range(len(tokens), -1, -1)
                    if float(torch.rand((), generator=generator, dtype=torch.float64)) < stop[i] or i == 0)
        return Verdict(nodes[1 : kept + 1], draw(p[nodes[kept]], generator))


class ResidualFreeTraversal(TraversalVerifier):
    """Traversal verification that keeps testing a node's later children, and draws its bonus, against the unchanged
    target after a rejection (only the weight is updated)."""

    name = "residual_free_traversal"

    def verify(self, tree, target_logits, sampling, generator):
        p = target_probs(target_logits, sampling)
        kids = tree.children_lists()

        def visit(node, alpha):
            for child in kids[node]:
                q = draft_dist(tree, node, self.name)
                y = tree.tokens[child]
                yield from visit(child, weight_step(alpha, float(p[node, y]), float(q[y])))
                alpha, _ = reject_below(alpha, p[node], q)
            yield node, alpha

        for node, alpha in visit(0, 1.0):
            if float(torch.rand((), generator=generator, dtype=torch.float64)) < alpha or node == 0:
                return Verdict(tree.path(node)[1:], draw(p[node], generator))


class ResidualFreeGreedyDraft(GreedyDraftVerifier):
    """Greedy multi-draft verification that, having rejected the sampled child, draws from p, not norm(max(p - q', 0))."""

    name = "residual_free_greedy_draft"

    def verify(self, tree, target_logits, sampling, generator):
        return multi_draft_walk(tree, target_probs(target_logits, sampling), residual_free_plan, self.name, generator)


WRONG = [
    (ForgetfulSpS(), ("chain", dict(k=3)), "T0.7,k4"),
    ("mbr", ("iid", dict(depth=2, branch=3)), "T0.7,k4"),  # multi-branch rejection on children drawn WITH replacement
    ("sps", ("static", dict(widths="1,1,1")), "T0.7,k4"),  # speculative sampling on deterministic (argmax) children
    (ResidualFreeBlock(), ("chain", dict(k=3)), "T0.7,k4"),
    (ResidualFreeTraversal(), ("iid", dict(depth=2, branch=3)), "T0.7,k4"),
    (ResidualFreeGreedyDraft(), ("greedy_draft", dict(depth=2, branch=3)), "T0.7,k4"),
]  # (mss on children drawn without replacement is caught exactly in test_rules)
WRONG_IDS = ["forgetful_sps", "mbr_on_iid", "sps_on_argmax_chain", "residual_free_block", "residual_free_traversal",
             "residual_free_greedy_draft"]


WRONG_TV = 0.05  # the wrong rules above are 0.075 (mbr_on_iid) to 0.48 TV from the target (measured, n ~ 4700)


@pytest.mark.slow
@pytest.mark.parametrize("verifier,drafting,setting", WRONG, ids=WRONG_IDS)
def test_wrong_verifier_is_caught(tables, verifier, drafting, setting):
    """The chi-square test rejects each wrong rule with samples planned for power 0.95 against *any* 0.05-TV
    deviation (~4700 samples, an eighth of the 0.02-TV plan the exact tests use): a test with that many more samples
    (the exact tests') rejects them at least as surely, and the closest wrong rule, 0.075 TV off, still fails at
    p ~ 1e-20."""
    method, options = policy(drafting)
    counts, probs = run(tables, method, verifier, setting, seed=1234, tv=WRONG_TV, **options)
    rep = goodness_of_fit(counts, probs, tv=WRONG_TV)
    print(f"\nwrong {getattr(verifier, 'name', verifier)} on {drafting[0]}: TV={rep.empirical_tv:.4f} p={rep.p_value:.2e}")
    with pytest.raises(AssertionError, match="do not follow"):
        assert_same_distribution(counts, probs, tv=WRONG_TV)


# ---- the lossy verifier ------------------------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("drafting", [("static", dict(depth=3, branch=2)), ("chain", dict(k=3))], ids=["static", "chain"])
def test_wetap_is_lossy_and_measured(tables, drafting, record_property):
    method, options = drafting
    counts, probs = run(tables, method, "wetap", "T1", seed=99, n=10000, **options)
    rep = goodness_of_fit(counts, probs)
    record_property("wetap_tv", rep.empirical_tv)
    print(f"\nwetap (tau={VERIFIERS['wetap']().tau}) on {method} at T=1: total variation from the target "
          f"{rep.empirical_tv:.4f} over the first {K} tokens (n={rep.n})")
    assert rep.p_value < 1e-3  # the drift is real, not sampling noise


def test_engine_refuses_wetap_without_allow_lossy(models):
    target, draft = models
    with pytest.raises(ValueError, match="does not preserve the target distribution.*allow_lossy"):
        SpeculativeDecoder(target, draft, method="static", temperature=1.0, verifier="wetap")
    dec = SpeculativeDecoder(target, draft, method="static", temperature=1.0, verifier="wetap", allow_lossy=True)
    assert dec.generate(PROMPT, max_new_tokens=6, seed=0, ignore_eos=True).stats.lossy


# ---- ASpS and block verification accept at least as much as SpS, on the same drafts --------------------------------------
def exact_chain_expectations(tables, n, setting):
    """E[tokens per step] of sps, asps and block for a chain of n drafted tokens from the prompt, exactly: every chain the
    draft can draw, weighted by its draft probability."""
    target, draft = tables
    cfg = SETTINGS[setting]
    sampling = SamplingConfig(cfg["temperature"], cfg.get("top_k", 0), cfg.get("top_p", 1.0))
    dsampling = SamplingConfig(cfg.get("draft_temperature", cfg["temperature"]), sampling.top_k, sampling.top_p)
    totals = {"sps": 0.0, "asps": 0.0, "block": 0.0}
    frontier = [((), 1.0)]
    for _ in range(n):  # all chains with positive draft probability
        frontier = [(c + (t,), w * float(dsampling.probs(draft.logits(c))[t]))
                    for c, w in frontier for t in range(VOCAB)]
        frontier = [(c, w) for c, w in frontier if w > 0]
    for chain, w in frontier:
        prefixes = [chain[:i] for i in range(n + 1)]
        q = torch.stack([dsampling.probs(draft.logits(s)) for s in prefixes[:n]])
        p = torch.stack([sampling.probs(target.logits(s)) for s in prefixes])
        totals["sps"] += w * expected_tokens(sps_neighbor(list(chain), q, p), list(chain))
        totals["asps"] += w * expected_tokens(asps_neighbor(list(chain), q, p), list(chain))
        totals["block"] += w * expected_tokens(block_neighbor(list(chain), q, p), list(chain))
    return totals


@pytest.mark.parametrize("setting", ["T1", "p0.8", "T1.3,k5,p0.9,dT0.8"])
def test_asps_and_block_accept_at_least_as_many_tokens_as_sps(tables, setting):
    for n in (1, 2, 3):
        e = exact_chain_expectations(tables, n, setting)
        print(f"\n{setting} n={n}: tokens/step sps {e['sps']:.4f} asps {e['asps']:.4f} block {e['block']:.4f}")
        assert e["block"] == pytest.approx(e["asps"], abs=1e-6)  # the same coupling (float32 warps: rows sum to 1 +- 1e-7)
        if n == 1:
            assert e["asps"] == pytest.approx(e["sps"], abs=1e-6)  # float32 warps: rows sum to 1 +- 1e-7
        else:
            assert e["asps"] > e["sps"]


def test_simulated_acceptance_matches_expectation(tables):
    """The verifier, run, accepts what the exact expectation says (mean drafted tokens accepted per first step)."""
    target, draft = tables
    e = exact_chain_expectations(tables, 3, "T1")
    for name in ("sps", "asps", "block"):
        dec = TableDecoder(target, draft, "chain", name, temperature=1.0, horizon=HORIZON, k=3)
        gen = torch.Generator().manual_seed(5)
        with sampling_mode():
            acc = [dec.generate(PROMPT, 1, generator=gen).accepted[0] for _ in range(4000)]
        mean, sd = sum(acc) / len(acc), torch.tensor(acc, dtype=torch.float64).std().item()
        assert abs(mean - (e[name] - 1)) < 4 * sd / len(acc) ** 0.5


# ---- end to end through the real engine -------------------------------------------------------------------------------
E2E = [
    ("chain", dict(k=3), "asps", "T1"),
    ("static", dict(depth=3, branch=2), "mbr", "T0.7,k4"),
    ("iid", dict(depth=2, branch=2), "mss", "p0.8"),
]


@pytest.mark.slow
@pytest.mark.parametrize("method,options,verifier,setting", E2E, ids=[e[2] for e in E2E])
def test_end_to_end_speculative_decoder(models, tables, monkeypatch, method, options, verifier, setting):
    """A smaller run through SpeculativeDecoder on the real tiny models: catches a 0.15 TV error with power 0.95."""
    target, draft = models
    if method == "iid":
        monkeypatch.setitem(POLICIES, "iid", IIDTreePolicy)
    dec = SpeculativeDecoder(target, draft, method=method, verifier=verifier, **SETTINGS[setting], **options)
    probs = exact_target_distribution(tables[0], PROMPT, K, dec.sampling)
    n = plan_samples(probs, tv=0.15)
    counts = sample_outputs(dec, PROMPT, K, n, seed=7, max_new_tokens=HORIZON)
    rep = assert_same_distribution(counts, probs, tv=0.15)
    print(f"\nengine {method}/{verifier} {setting}: n={rep.n} p={rep.p_value:.3f} TV={rep.empirical_tv:.4f}")


# ---- temperature 0: the new rules are greedy, on the tables ----------------------------------------------------------------
@pytest.mark.parametrize("verifier,drafting", [
    ("block", ("chain", dict(k=3))),
    ("traversal", ("static", dict(depth=3, branch=2))),
    ("traversal", ("iid", dict(depth=2, branch=3))),
    ("greedy-draft", ("greedy_draft", dict(depth=3, branch=3))),
    ("greedy-draft", ("static", dict(widths="3,2,2"))),
    ("greedy-draft", ("static", dict(depth=3, branch=3, draw="greedy"))),
], ids=["block", "traversal_static", "traversal_iid", "greedy_draft", "greedy_draft_widths", "greedy_draft_static"])
def test_new_verifiers_are_greedy_at_temperature_zero(tables, verifier, drafting):
    method, options = policy(drafting)
    target, draft = tables
    ours = TableDecoder(target, draft, method, verifier, temperature=0.0, horizon=HORIZON, **options)
    ref = TableDecoder(target, draft, method, "greedy", temperature=0.0, horizon=HORIZON, **options)
    for new_tokens in (1, 2, 3):
        a, b = ours.generate(PROMPT, new_tokens, seed=0), ref.generate(PROMPT, new_tokens, seed=1)
        assert a.token_ids == b.token_ids and a.accepted == b.accepted  # (the engine test also checks acceptances)


# ---- the harness itself ----------------------------------------------------------------------------------------------
def test_table_matches_the_model_and_exact_distribution_is_normalised(models, tables):
    target, _ = models
    table = tables[0]
    with torch.no_grad():
        direct = target(input_ids=torch.tensor([PROMPT + [3, 6]])).logits[0, -1]
    assert torch.allclose(table.logits((3, 6)), direct, atol=1e-5)
    for cfg in SETTINGS.values():
        sampling = SamplingConfig(cfg["temperature"], cfg.get("top_k", 0), cfg.get("top_p", 1.0))
        probs = exact_target_distribution(table, PROMPT, 3, sampling)
        assert probs.shape == (VOCAB**3,) and float(probs.sum()) == pytest.approx(1.0)
        # P(t1 = 4, t2 = 1, t3 = 6) by hand
        by_hand = (sampling.probs(table.logits(()))[4] * sampling.probs(table.logits((4,)))[1]
                   * sampling.probs(table.logits((4, 1)))[6])
        assert float(probs[4 * 64 + 1 * 8 + 6]) == pytest.approx(float(by_hand), rel=1e-6)
