"""Lookahead branches: the window is the paper's mask as a tree, the Jacobi step fills the pool, decoding stays exact."""

import pytest
import torch

from arborspec import SpeculativeDecoder
from arborspec.core.tree import MAX_TREE_NODES, DrawRule, TokenTree
from arborspec.drafting.grafts.lookahead import Lookahead
from tests.conftest import noisy_copy, tiny_model
from tests.drafting.equivalence import greedy_results, repetitive_prompts

pytestmark = pytest.mark.usefixtures("private_cache")  # ar prices free branches by a profile: not in ~/.cache


def logits_for(tree: TokenTree, argmax: dict[int, int], vocab: int = 64) -> torch.Tensor:
    """(len(tree), vocab) logits whose row of node i peaks at argmax[i] (token 0 elsewhere)."""
    out = torch.zeros(len(tree), vocab)
    for node, tok in argmax.items():
        out[node, tok] = 5.0
    return out


def test_the_window_is_a_tree_and_the_jacobi_step_fills_the_pool():
    la = Lookahead(window=3, ngram=3, guesses=2)
    # step 1: level 0 from the tokens before the root, as a chain under it
    tree = la.graft(TokenTree.root(8), [5, 6, 7, 8], room=10)
    assert tree.tokens == [8, 5, 6, 7] and tree.parents == [-1, 0, 1, 2] and la.nodes == [[1, 2, 3]]
    la.observe(logits_for(tree, {1: 11, 2: 12, 3: 13}))
    assert la.levels == [[5, 6, 7], [11, 12, 13]] and la.pool == {}
    # step 2: level 1's guess of column j hangs below level 0's column j (it sees level 0's columns up to j)
    tree = la.graft(TokenTree.root(9), [5, 6, 7, 8, 9], room=10)
    assert tree.tokens == [9, 5, 6, 7, 11, 12, 13] and tree.parents == [-1, 0, 1, 2, 1, 2, 3]
    assert [tree.depths[n] for n in la.nodes[1]] == [2, 3, 4]  # column j, level l at position j + l + 1
    la.observe(logits_for(tree, {4: 21, 5: 22, 6: 23}))
    assert {k: list(v) for k, v in la.pool.items()} == {5: [(11, 21)], 6: [(12, 22)], 7: [(13, 23)]}
    assert la.levels == [[11, 12, 13], [21, 22, 23]]  # the oldest level dropped
    # step 3: the root is 5, so the pool's 5-gram is proposed first, and the window merges with it
    tree = la.graft(TokenTree.root(5), [1, 5], room=10)
    assert tree.tokens == [5, 11, 21, 12, 13, 22, 23] and tree.parents == [-1, 0, 1, 1, 3, 3, 4]
    assert la.nodes == [[1, 3, 4], [2, 5, 6]] and set(tree.sources[1:]) == {"lookahead"}
    assert all(tree.child_rule[p] == DrawRule.DETERMINISTIC for p in set(tree.parents[1:]))
    tree.validate()


def test_the_pool_keeps_the_most_recent_ngrams_per_first_token():
    la = Lookahead(window=1, ngram=2, guesses=2)
    for tok in (3, 4, 3, 5, 3, 6):  # with N = 2, each step's (guess, next guess) of column 0 is one 2-gram
        tree = la.graft(TokenTree.root(9), [9, 9], room=4)
        la.observe(logits_for(tree, {la.nodes[-1][0]: tok}))
    assert la.levels == [[6]]
    assert {k: list(v) for k, v in la.pool.items()} == {9: [(3,)], 3: [(5,), (6,)], 4: [(3,)], 5: [(3,)]}  # 3 -> 4 out
    tree = la.graft(TokenTree.root(3), [3], room=4)
    assert tree.tokens == [3, 6, 5]  # most recent first; the window's guess (6) merges with it


def test_room_limits_what_is_proposed():
    la = Lookahead(window=3, ngram=2, guesses=4)
    la.levels, la.pool = [[1, 2, 3]], {7: {(4,): None}}
    tree = la.graft(TokenTree.root(7), [7], room=2)  # the window needs depth 3: only the pool's 2-gram fits
    assert tree.tokens == [7, 4] and la.nodes == []
    la.observe(torch.zeros(len(tree), 8))  # no window this step: nothing to learn
    assert la.levels == [[1, 2, 3]]
    assert Lookahead(2, 2, 2).graft(TokenTree.root(7), [7], room=0).tokens == [7]


def test_the_first_window_cycles_the_tokens_before_the_root():
    """A context shorter than the window fills level 0 by cycling the tokens before the root (3 4 3 4 3), not by
    repeating the last of them."""
    la = Lookahead(window=5, ngram=2, guesses=1)
    tree = la.graft(TokenTree.root(9), [3, 4, 9], room=10)
    assert la.levels == [[3, 4, 3, 4, 3]] and tree.tokens == [9, 3, 4, 3, 4, 3]


def test_room_and_node_limits_are_exact():
    """The window (span W + levels - 1 deep, W x levels nodes) goes in when room and nodes are exactly enough and
    stays out one short; a pool n-gram is cut to `room` tokens and goes in when it fills `nodes` exactly."""
    def primed() -> Lookahead:
        la = Lookahead(window=2, ngram=3, guesses=4)
        la.levels, la.pool = [[1, 2], [3, 4]], {7: {(5, 6): None}}  # span 3, 4 window nodes; a 2-token pool n-gram
        return la
    la = primed()
    tree = la.graft(TokenTree.root(7), [7], room=3, nodes=6)  # 2 pool nodes + 4 window nodes: exactly enough
    assert tree.tokens == [7, 5, 6, 1, 2, 3, 4] and la.nodes == [[3, 4], [5, 6]]
    la = primed()
    assert la.graft(TokenTree.root(7), [7], room=3, nodes=5).tokens == [7, 5, 6] and la.nodes == []  # 1 node short
    la = primed()
    assert la.graft(TokenTree.root(7), [7], room=2, nodes=6).tokens == [7, 5, 6] and la.nodes == []  # 1 level short
    assert primed().graft(TokenTree.root(7), [7], room=1).tokens == [7, 5]  # the n-gram cut to the room
    assert primed().graft(TokenTree.root(7), [7], room=3, nodes=2).tokens == [7, 5, 6]  # the n-gram fills `nodes`
    assert primed().graft(TokenTree.root(7), [7], room=3, nodes=1).tokens == [7]  # ... or is left out whole


def test_an_ngram_produced_again_becomes_the_most_recent():
    """The pool keeps the `guesses` most recently *produced* n-grams: one produced again moves to the front of the
    proposals and outlives an older one produced once."""
    la = Lookahead(window=1, ngram=2, guesses=2)
    for cont in ((4,), (5,), (4,), (6,)):
        la._remember(3, cont)
    assert list(la.pool[3]) == [(4,), (6,)]  # (5,) was the least recently produced
    assert la.graft(TokenTree.root(3), [3], room=0).tokens == [3]  # (no room: nothing)
    la.levels = [[8]]
    assert la.graft(TokenTree.root(3), [3], room=1).tokens == [3, 6, 4, 8]  # most recent first


def test_option_bounds_are_inclusive():
    """guesses = 0 (a window, no pool n-grams) is valid, and so is a step of exactly MAX_TREE_NODES tokens."""
    la = Lookahead(window=1, ngram=2, guesses=0)
    for _ in range(3):
        tree = la.graft(TokenTree.root(9), [9, 9], room=4)
        la.observe(logits_for(tree, {la.nodes[-1][0]: 9}))
    assert all(not grams for grams in la.pool.values())
    assert Lookahead(window=MAX_TREE_NODES // 2, ngram=3, guesses=0).window == MAX_TREE_NODES // 2
    with pytest.raises(ValueError, match="at most 1024"):
        Lookahead(window=MAX_TREE_NODES // 2, ngram=3, guesses=1)


@pytest.mark.parametrize("bad", [dict(window=0), dict(ngram=1), dict(guesses=-1), dict(window=2.5)])
def test_bad_options_say_which(bad):
    with pytest.raises(ValueError, match="lookahead " + next(iter(bad))):
        Lookahead(**bad)


@pytest.mark.parametrize("method,options", [("ar", {"lookahead": 4}), ("ar", {"lookahead": 3, "lookahead_ngram": 4}),
                                            ("static", {"depth": 2, "branch": 2, "lookahead": 3})])
def test_lookahead_branches_keep_greedy_output(method, options, monkeypatch):
    """Greedy identity, with lookahead's proposals accepted. The graft budget keeps rows only where they pay under
    the measured costs: a profile measured on a loaded host (a CI run beside other work) left every lookahead row
    out, so the costs here are a flat curve (rows free) and the rows always pay."""
    from arborspec.tuning import costs
    flat = costs.CostCurve.from_measurements([1, 128], [0.01, 0.01])
    monkeypatch.setattr(costs, "profile_model", lambda model, **kw: (flat, "measured"))
    target = tiny_model("llama", seed=0)
    draft = noisy_copy(target, 0.5) if method != "ar" else None
    dec = SpeculativeDecoder(target, draft, method=method, **options)
    assert dec.verifier.name == "greedy"
    results = greedy_results(dec, target, repetitive_prompts(3, period=6), max_new_tokens=32)
    credited = sum(res.stats.sources.get("lookahead", {}).get("accepted", 0) for res in results)
    if method == "ar":  # no draft model: every node is the window's or the pool's
        assert all(set(res.stats.sources) <= {"lookahead"} for res in results)
    assert credited > 0  # lookahead's own proposals were accepted, so the identity means something


def test_lookahead_at_temperature_needs_an_any_tree_verifier():
    target = tiny_model("llama", seed=0)
    assert SpeculativeDecoder(target, method="ar", lookahead=2, temperature=1.0).verifier.name == "naive"
    with pytest.raises(ValueError, match="not exact"):
        SpeculativeDecoder(target, noisy_copy(target, 0.2), method="static", lookahead=2, temperature=1.0,
                           verifier="mbr")
    with pytest.raises(ValueError, match="lookahead ngram"):
        SpeculativeDecoder(target, method="ar", lookahead=2, lookahead_ngram=1)


@pytest.mark.slow
def test_lookahead_branches_keep_the_target_distribution():
    """At T = 1, root-only trees with lookahead branches (one window and pool kept across runs, so the proposals
    change from run to run), verified by `naive`, emit the target's distribution of the first tokens."""
    from tests.drafting.equivalence import assert_samples_target, table_pair
    from tests.verify.harness import TableDecoder, TableResult

    horizon = 5
    table, _, prompt, probs = table_pair(horizon=horizon, prompt=[1, 3, 1, 3, 1])

    class LookaheadDecoder(TableDecoder):
        """The engine's loop with the lookahead graft and Jacobi step, on table sessions."""

        lookahead = Lookahead(window=2, ngram=2, guesses=2)
        proposed = 0

        def generate(self, prompt, max_new_tokens, seed=None, ignore_eos=True, generator=None):
            session, context, out = self.target.session(), list(prompt), TableResult([])
            while len(out.token_ids) < max_new_tokens:
                room = horizon - len(out.token_ids) - 1
                tree = self.lookahead.graft(TokenTree.root(context[-1]), context, max(room, 0))
                logits = session.forward(context, tree, list(range(len(tree))))
                self.lookahead.observe(logits)
                verdict = self.verifier.verify(tree, logits, self.sampling, generator)
                kept = ([tree.tokens[i] for i in verdict.path] + [verdict.bonus])[: max_new_tokens - len(out.token_ids)]
                session.commit([0] + verdict.path)
                context, out.token_ids = context + kept, out.token_ids + kept
                LookaheadDecoder.proposed += len(tree) - 1
            return out

    dec = LookaheadDecoder(table, None, method="ar", verifier="naive", temperature=1.0, horizon=horizon)
    assert_samples_target(dec, prompt, probs)
    assert LookaheadDecoder.lookahead.pool and LookaheadDecoder.proposed > 0  # branches really were in the trees
