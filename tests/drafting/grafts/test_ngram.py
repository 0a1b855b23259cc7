"""Prompt-lookup branches: found where the context repeats, grafted without duplicates, verified exactly."""
import random

import pytest
import torch

from arborspec import SpeculativeDecoder
from arborspec.core.tree import DrawRule, TokenTree
from arborspec.drafting.grafts.ngram import add_ngram_branch, graft, lookup
from tests.conftest import noisy_copy, tiny_model

pytestmark = pytest.mark.usefixtures("private_cache")  # ar prices free branches by a profile: not in ~/.cache


def test_lookup_finds_the_most_recent_continuation():
    ctx = [1, 2, 3, 9, 9, 1, 2, 3, 7, 8, 5, 1, 2, 3]
    assert lookup(ctx, max_ngram=3, length=2) == [7, 8]  # the latest earlier "1 2 3" was followed by 7 8
    assert lookup(ctx, max_ngram=3, length=10) == [7, 8, 5, 1, 2, 3]
    assert lookup([4, 5, 6], max_ngram=2, length=3) == []
    assert lookup([5, 6, 5], max_ngram=3, length=2) == [6, 5]  # falls back to shorter n-grams


def test_graft_reuses_existing_children_and_marks_them_deterministic():
    tree = TokenTree.from_parents([0, 7, 4], [-1, 0, 0])
    chain = graft(tree, [7, 8, 9])
    assert chain[0] == 1  # token 7 was already a child of the root
    assert [tree.tokens[n] for n in chain] == [7, 8, 9] and len(tree) == 5
    assert tree.child_rule[1] == DrawRule.DETERMINISTIC and tree.child_rule[3] == DrawRule.DETERMINISTIC
    tree.validate()


def test_lookup_sees_an_occurrence_that_overlaps_the_tail():
    """The most recent earlier occurrence may end one token before the tail does (start = len - n - 1): here the
    unigram 5 just before the last 5, followed by that 5, not the older 5 followed by 8."""
    assert lookup([5, 8, 5, 5], max_ngram=2, length=2) == [5]


def test_a_unigram_lookup_grafts_a_branch():
    """max_ngram = 1 is a valid size (lookup falls back to it anyway): the branch is grafted, not skipped."""
    tree = add_ngram_branch(TokenTree.root(3), [3, 4, 3], max_ngram=1, length=2)
    assert tree.tokens == [3, 4, 3] and tree.sources[1:] == ["ngram", "ngram"]


def test_graft_records_the_draft_probability_and_credits_a_reproposed_node():
    """A new child under a node with a draft distribution records that distribution's probability of its token (0 where
    no distribution is recorded: the draft never proposed it); a child that already existed stays credited to its
    first source, with the graft's source recorded in `also` (core/tree.py's crediting)."""
    tree = TokenTree.from_parents([0, 7], [-1, 0])
    tree.set_children_dist(0, torch.tensor([0.0, 0.0, 0.25, 0.0, 0.0, 0.0, 0.0, 0.75]), DrawRule.WITH_REPLACEMENT)
    chain = graft(tree, [7, 5])
    assert chain == [1, 2] and tree.sources == ["", "draft", "ngram"] and tree.also == {1: ["ngram"]}
    assert tree.probs[2] == 0.0  # node 1 has no recorded distribution
    (node,) = graft(tree, [2])
    assert tree.probs[node] == 0.25 and tree.child_rule[0] == DrawRule.DETERMINISTIC


@pytest.mark.parametrize("method,options", [("ar", {}), ("chain", {"k": 3}), ("static", {"depth": 2, "branch": 2})])
def test_ngram_branches_keep_greedy_output(method, options):
    target = tiny_model("llama", seed=0)
    draft = noisy_copy(target, 0.5)
    rng = random.Random(0)
    for _ in range(3):
        base = [rng.randrange(2, 56) for _ in range(8)]
        prompt = base * 3  # repetitive: the target tends to continue the pattern, lookups find it
        ref = SpeculativeDecoder(target, method="ar").generate(prompt, max_new_tokens=24, ignore_eos=True)
        dec = SpeculativeDecoder(target, draft if method != "ar" else None, method=method, ngram=3, ngram_len=6,
                                 **options)
        res = dec.generate(prompt, max_new_tokens=24, ignore_eos=True)
        assert res.token_ids == ref.token_ids


def test_ngram_forces_an_exact_verifier_at_temperature():
    target = tiny_model("llama", seed=0)
    draft = noisy_copy(target, 0.2)
    dec = SpeculativeDecoder(target, draft, method="static", temperature=1.0, ngram=2)
    assert dec.verifier.name == "naive"
    with pytest.raises(ValueError, match="not exact"):
        SpeculativeDecoder(target, draft, method="static", temperature=1.0, ngram=2, verifier="mbr")
    with pytest.raises(ValueError, match="not exact"):
        SpeculativeDecoder(target, draft, method="chain", temperature=1.0, ngram=2, verifier="sps")
    with pytest.raises(ValueError, match="ngram"):
        SpeculativeDecoder(target, draft, method="chain", ngram=-1)


@pytest.mark.slow
def test_ngram_branches_keep_the_target_distribution():
    """Sampled static trees with a grafted lookup branch, verified by `naive`, emit the target's distribution."""
    from arborspec.drafting import POLICIES
    from arborspec.drafting.grafts.ngram import add_ngram_branch
    from tests.drafting.equivalence import assert_samples_target, table_pair
    from tests.verify.harness import TableDecoder

    class WithLookup(POLICIES["static"]):
        def draft(self, ctx):
            return add_ngram_branch(super().draft(ctx), ctx.context, 2, ctx.max_depth)

    t_table, d_table, prompt, probs = table_pair(prompt=[1, 3, 1])  # it repeats "1": a lookup branch is grafted
    dec = TableDecoder(t_table, d_table, method=WithLookup(depth=2, branch=2), verifier="naive", temperature=1.0,
                       horizon=4)
    assert_samples_target(dec, prompt, probs)
