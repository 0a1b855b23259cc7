"""Suffix drafts: the index agrees with a brute-force scan, the store stays bounded, decoding stays exact."""
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from arborspec import SpeculativeDecoder
from arborspec.core.tree import DrawRule, TokenTree
from arborspec.drafting import POLICIES
from arborspec.drafting.grafts.suffix import SuffixPolicy, graft_suffix_branches, speculation_tree
from arborspec.drafting.grafts.suffix_index import CountTrie, OutputStore, SuffixIndex
from tests.conftest import noisy_copy, tiny_model
from tests.drafting.equivalence import greedy_results, repetitive_prompts

pytestmark = pytest.mark.usefixtures("private_cache")  # ar prices free branches by a profile: not in ~/.cache


# ---- brute-force reference ---------------------------------------------------------------------------------------
def occurrences(seqs, string) -> int:
    m = len(string)
    return sum(s[i : i + m] == list(string) for s in seqs for i in range(len(s) - m + 1))


def next_counts(seqs, string) -> Counter:
    """Tokens that followed `string`, counted over every occurrence in every sequence (no crossing between them)."""
    m, out = len(string), Counter()
    for s in seqs:
        for i in range(len(s) - m):
            if s[i : i + m] == list(string):
                out[s[i + m]] += 1
    return out


def naive_match(seqs, tokens, max_match, min_match=1) -> int:
    for m in range(min(max_match, len(tokens)), max(min_match, 1) - 1, -1):
        if next_counts(seqs, tokens[-m:]):
            return m
    return 0


def trie_table(trie: CountTrie) -> dict:
    """{string: (count, cont)} for every live node: a canonical form independent of node numbering."""
    out, stack = {}, [((), 0)]
    while stack:
        string, node = stack.pop()
        out[string] = (trie.count[node], trie.cont[node])
        for tok, child in (trie.kids[node] or {}).items():
            stack.append((string + (tok,), child))
    return out


def naive_table(seqs, depth) -> dict:
    strings = {tuple(s[i : i + m]) for s in seqs for m in range(1, depth + 1) for i in range(len(s) - m + 1)}
    out = {st_: (occurrences(seqs, st_), sum(next_counts(seqs, st_).values()) if len(st_) < depth else 0)
           for st_ in strings}
    out[()] = (sum(len(s) for s in seqs), sum(len(s) for s in seqs))
    return out


streams = st.lists(st.integers(0, 3), min_size=0, max_size=50)


# ---- the trie and the index ----------------------------------------------------------------------------------------
@settings(max_examples=60, deadline=None)
@given(seqs=st.lists(streams, max_size=3), depth=st.integers(1, 6))
def test_trie_counts_every_substring_like_a_scan(seqs, depth):
    trie = CountTrie(depth)
    for s in seqs:
        trie.add(s)
    assert trie_table(trie) == naive_table(seqs, depth)
    assert len(trie) == len(naive_table(seqs, depth))  # no stray nodes


@settings(max_examples=60, deadline=None)
@given(tokens=streams, cuts=st.lists(st.integers(0, 50), max_size=6), max_match=st.integers(1, 5),
       max_depth=st.integers(1, 4), min_match=st.integers(0, 3))
def test_index_follows_incrementally_and_matches_a_scan(tokens, cuts, max_match, max_depth, min_match):
    ix = SuffixIndex(max_match, max_depth)
    for cut in sorted(cuts) + [len(tokens)]:  # the context grows by arbitrary chunks, as steps commit tokens
        prefix = tokens[: max(cut, 1)]
        if not prefix:
            continue
        ix.follow(prefix)
        assert ix.tokens == prefix
        m, _ = ix.match(min_match)
        assert m == naive_match([prefix], prefix, max_match, min_match)
    if tokens:
        rebuilt = SuffixIndex(max_match, max_depth)
        rebuilt.follow(tokens)
        assert trie_table(ix.request) == trie_table(rebuilt.request)


def all_continuations(seqs, tokens, m, depth):
    """{continuation: empirical path probability} for every continuation of the matched suffix up to `depth`."""
    out, frontier = {}, [((), 1.0)]
    for _ in range(depth):
        nxt = []
        for cont, p in frontier:
            counts = next_counts(seqs, tokens[len(tokens) - m :] + list(cont))
            total = sum(counts.values())
            for tok, c in counts.items():
                out[cont + (tok,)] = p * c / total
                nxt.append((cont + (tok,), p * c / total))
        frontier = nxt
    return out


@settings(max_examples=60, deadline=None)
@given(tokens=st.lists(st.integers(0, 3), min_size=1, max_size=40), outputs=st.lists(streams, max_size=3),
       max_match=st.integers(1, 4), max_depth=st.integers(1, 3), budget=st.integers(1, 12))
def test_speculation_is_the_most_probable_continuations(tokens, outputs, max_match, max_depth, budget):
    ix = SuffixIndex(max_match, max_depth, store=1000)
    for out in outputs:  # earlier requests: prompt [9], then the output
        ix.follow([9])
        ix.follow([9] + out)
    ix.follow(tokens)
    seqs = [tokens] + [o for o in outputs if o]
    spec = ix.speculate(budget)
    assert spec.match == naive_match(seqs, tokens, max_match)
    want = all_continuations(seqs, tokens, spec.match, max_depth) if spec.match else {}
    paths = []
    for c in spec.nodes:
        path = (paths[c.parent] if c.parent >= 0 else ()) + (c.token,)
        paths.append(path)
        assert c.path_prob == pytest.approx(want[path])
        assert c.prob == pytest.approx(want[path] / (want[path[:-1]] if len(path) > 1 else 1.0))
    assert len(set(paths)) == len(paths) == min(budget, len(want))
    top = sorted(want.values(), reverse=True)[: len(paths)]
    assert sorted((c.path_prob for c in spec.nodes), reverse=True) == pytest.approx(top)
    tree = speculation_tree(tokens[-1], spec)
    tree.validate()
    assert all(tree.child_rule[p] == DrawRule.DETERMINISTIC for p in set(tree.parents[1:]))


def test_speculation_sizes_by_match_and_probability():
    ix = SuffixIndex(8, 4)
    ix.follow([5, 6, 1, 2, 5, 6, 1, 3, 5, 6])  # "5 6" was followed by 1 twice, then by 2 or 3
    spec = ix.speculate(budget=10, factor=1.5)
    assert spec.match == 2 and len(spec.nodes) == 3  # ceil(1.5 * 2)
    assert len(ix.speculate(budget=10, factor=1.25).nodes) == 3  # ceil(2.5): rounded up, not down
    assert [c.token for c in spec.nodes] == [1, 2, 3] and spec.nodes[0].prob == 1.0
    assert len(ix.speculate(budget=10, min_prob=0.6).nodes) == 1  # the branches of probability 0.5 are left out
    assert ix.speculate(budget=10, min_match=3).nodes == []
    assert ix.speculate(budget=10, max_depth=1).nodes == spec.nodes[:1]
    assert ix.speculate(budget=10, max_depth=0).nodes == []  # no room left in the context window / token budget


def test_speculation_keeps_nodes_at_exactly_min_prob():
    ix = SuffixIndex(8, 4)
    ix.follow([5, 6, 1, 2, 5, 6, 1, 3, 5, 6])  # "5 6" -> 1 (prob 1), then 2 or 3 (path prob 0.5 each)
    assert [c.token for c in ix.speculate(budget=10, max_depth=2, min_prob=0.5).nodes] == [1, 2, 3]


def test_speculation_never_goes_deeper_than_the_index_max_depth():
    """A caller's max_depth above the index's is capped: a short match leaves room in the trie for more."""
    ix = SuffixIndex(8, 2)
    ix.follow([1, 2, 3, 4, 5, 6, 1])  # "1" matched, followed by the chain 2 3 4 5 6
    assert [c.token for c in ix.speculate(budget=10, max_depth=5).nodes] == [2, 3]


def test_speculation_size_by_match_is_not_rounded_up_by_float_error():
    """factor * match = 25/11 * 11 is 25.000000000000004 in floats: the tree gets 25 nodes, not 26."""
    suffix = list(range(1, 12))
    ix = SuffixIndex(11, 1)
    ix.follow([tok for t in range(100, 130) for tok in suffix + [t]] + suffix)  # 30 continuations of the suffix
    spec = ix.speculate(budget=40, factor=25 / 11)
    assert spec.match == 11 and len(spec.nodes) == 25


@settings(max_examples=40, deadline=None)
@given(outputs=st.lists(streams, max_size=8), capacity=st.integers(0, 60), depth=st.integers(1, 5))
def test_store_evicts_whole_outputs_oldest_first(outputs, capacity, depth):
    outputs = [[7] * (capacity + 3)] + outputs  # the first is too long for the store: only its tail is kept
    store, model = OutputStore(depth, capacity), []
    for out in outputs:
        store.add(out)
        if out and capacity:  # the reference: append the (truncated) output, drop the oldest while over capacity
            model.append(out[max(len(out) - capacity, 0):])
            while sum(map(len, model)) > capacity:
                model.pop(0)
        assert list(store.outputs) == model
        assert store.tokens == sum(map(len, model)) <= capacity
    assert trie_table(store.trie) == naive_table(model, depth)
    assert len(store.trie) == len(naive_table(model, depth))  # evicted nodes are gone


def test_index_moves_finished_outputs_to_the_store():
    ix = SuffixIndex(4, 4, store=8)
    ix.follow([1, 2])
    ix.follow([1, 2, 7, 8, 9])  # generated 7 8 9
    ix.follow([3, 7])  # a new request: 7 8 9 goes to the store
    assert list(ix.store.outputs) == [[7, 8, 9]] and ix.tokens == [3, 7]
    assert [c.token for c in ix.speculate(4).nodes] == [8, 9]
    with pytest.raises(ValueError, match="store"):
        SuffixIndex(store=-1)


def test_index_following_the_same_context_again_keeps_the_request():
    ix = SuffixIndex(4, 4, store=8)
    ix.follow([1, 2])
    ix.follow([1, 2, 7, 8])
    ix.follow([1, 2, 7, 8])  # a step that committed nothing new: still the same request
    assert list(ix.store.outputs) == [] and ix.tokens == [1, 2, 7, 8] and ix.prompt_len == 2


def test_follow_judges_a_new_request_by_the_first_and_last_16_tokens():
    """follow's O(1) continuity rule: the context must agree with what is indexed on its first and last
    min(16, n) tokens; a disagreement at either end, however short or long the request, starts a new one."""
    long = list(range(20))
    for first, then in [([5], [7, 8]),  # one token indexed: it is compared too
                        ([1, 2, 3], [1, 9, 3, 4]),  # a short request is compared whole
                        (long, [99] + long[1:] + [50]),  # its first token differs (outside the last 16)
                        (long, long[:19] + [77, 50])]:  # its last token differs (outside the first 16)
        ix = SuffixIndex(4, 4, store=64)
        ix.follow(first)
        ix.follow(then)
        assert ix.tokens == then and ix.prompt_len == len(then), (first, then)


def test_bad_index_sizes_are_refused():
    for bad in (lambda: CountTrie(0), lambda: SuffixIndex(max_match=0), lambda: SuffixIndex(max_depth=0),
                lambda: SuffixIndex(store=2.5), lambda: OutputStore(2, -1)):
        with pytest.raises(ValueError):
            bad()
    assert OutputStore(2, 0).capacity == 0  # a store of 0 tokens is allowed: no store


def test_evicted_trie_nodes_are_reused():
    """Node ids freed by an eviction are taken first by the next output: the arrays do not grow with the traffic."""
    store = OutputStore(3, 4)
    store.add([1, 2, 3, 4])  # 4 + 3 + 2 substrings of length <= 3, and the root
    for out in ([5, 6, 7, 8], [9, 10, 11, 12], [1, 2, 3, 4]):
        store.add(out)  # evicts the previous one whole
        assert len(store.trie) == len(store.trie.count) == 10


# ---- grafting ----------------------------------------------------------------------------------------------------
def test_graft_merges_with_drafted_children():
    tree = TokenTree.from_parents([2, 3, 4], [-1, 0, 0])
    ix = SuffixIndex(4, 4)
    context = [1, 2, 3, 5, 6, 1, 2]  # "1 2" was followed by 3 5 6
    graft_suffix_branches(tree, ix, context, budget=3)
    tree.validate()
    assert tree.tokens == [2, 3, 4, 5, 6] and tree.parents == [-1, 0, 0, 1, 3]
    assert 0 not in tree.child_rule  # the root's children are unchanged: 3 was drafted already
    assert tree.child_rule[1] == DrawRule.DETERMINISTIC and tree.child_rule[3] == DrawRule.DETERMINISTIC
    before = len(tree)
    graft_suffix_branches(tree, ix, context, budget=0)
    assert len(tree) == before


# ---- exactness end to end ----------------------------------------------------------------------------------------
@pytest.fixture
def registered(monkeypatch):
    monkeypatch.setitem(POLICIES, "suffix", SuffixPolicy)

    class StaticWithSuffix(POLICIES["static"]):
        """A draft-model tree plus grafted suffix branches (what the engine's --suffix lever would do)."""

        def __init__(self, **options):
            super().__init__(**options)
            self.index = SuffixIndex(8, 4)
            self.drafted_size, self.grafted_accepted = 0, 0

        def draw_rules(self, sampling):
            return super().draw_rules(sampling) | {DrawRule.DETERMINISTIC}

        def draft(self, ctx):
            tree = super().draft(ctx)
            self.drafted_size = len(tree)  # grafted nodes are appended after the drafted ones
            return graft_suffix_branches(tree, self.index, ctx.context, 6, ctx.max_depth)

        def update(self, step):
            super().update(step)
            self.grafted_accepted += sum(n >= self.drafted_size for n in step.path)

    monkeypatch.setitem(POLICIES, "static+suffix", StaticWithSuffix)


@pytest.mark.parametrize("method,options", [("suffix", {}), ("suffix", {"budget": 4, "factor": 0.0, "store": 64}),
                                            ("static+suffix", {"depth": 2, "branch": 2}),
                                            ("static", {"depth": 2, "branch": 2, "suffix": 6})])
def test_suffix_drafts_keep_greedy_output(registered, method, options):
    target = tiny_model("llama", seed=0)
    draft = noisy_copy(target, 0.5) if method != "suffix" else None
    dec = SpeculativeDecoder(target, draft, method=method, **options)  # one decoder: the store sees every request
    assert dec.verifier.name == "greedy"
    results = greedy_results(dec, target, repetitive_prompts(3, period=8), max_new_tokens=24)
    accepted = sum(s.accepted for res in results for s in res.stats.steps)
    assert accepted > 0  # the drafts were used, so the identity means something
    if method == "static+suffix":
        assert dec.policy.grafted_accepted > 0  # grafted suffix nodes among them
    if options.get("store"):
        assert 0 < dec.policy.index.store.tokens <= 64
    if options.get("suffix"):  # the engine's lever: grafted branches must add accepted tokens over the bare policy
        bare = SpeculativeDecoder(target, draft, method=method, depth=2, branch=2)
        bare_accepted = sum(s.accepted for p in repetitive_prompts(3, period=8)
                            for s in bare.generate(p, max_new_tokens=24, ignore_eos=True).stats.steps)
        assert accepted > bare_accepted


def test_suffix_at_temperature_needs_an_any_tree_verifier(registered):
    target = tiny_model("llama", seed=0)
    assert SpeculativeDecoder(target, method="suffix", temperature=1.0).verifier.name == "naive"
    with pytest.raises(ValueError, match="not exact"):
        SpeculativeDecoder(target, method="suffix", temperature=1.0, verifier="mbr")
    draft = noisy_copy(target, 0.2)
    assert SpeculativeDecoder(target, draft, method="static+suffix", temperature=1.0).verifier.name == "naive"
    for bad in ({"budget": 0}, {"factor": -1.0}, {"factor": float("inf")}, {"min_prob": 2.0},
                {"min_prob": float("nan")}, {"min_match": 5, "max_match": 4}, {"store": -3}, {"depth": 3}):
        with pytest.raises(ValueError):
            SuffixPolicy(**bad)


@pytest.mark.slow
@pytest.mark.parametrize("which", ["suffix", "static+suffix"])
def test_suffix_drafts_keep_the_target_distribution(registered, which):
    """At T = 1, suffix trees (alone, with a store that changes them from run to run; or grafted onto sampled static
    trees) verified by `naive` emit the target's distribution of the first tokens."""
    from tests.drafting.equivalence import assert_samples_target, table_pair
    from tests.verify.harness import TableDecoder

    t_table, d_table, prompt, probs = table_pair(prompt=[1, 3, 1, 3, 1])  # it repeats: suffix branches are drafted
    d_table = None if which == "suffix" else d_table
    policy = SuffixPolicy(store=32) if which == "suffix" else POLICIES[which](depth=2, branch=2)
    dec = TableDecoder(t_table, d_table, method=policy, verifier="naive", temperature=1.0, horizon=4)
    index, matched = dec.policy.index, []
    speculate = index.speculate

    def recorded(*args, **kwargs):  # each speculation a tree was drafted from: did it match and add nodes?
        spec = speculate(*args, **kwargs)
        matched.append(spec.match > 0 and bool(spec.nodes))
        return spec

    index.speculate = recorded
    assert_samples_target(dec, prompt, probs)
    assert sum(matched) > len(matched) / 10  # suffix branches really were in the trees


def test_suffix_trees_stay_within_the_depth_the_step_leaves():
    """Near the end of a generation (or the context window) the engine asks for shallower trees: ctx.max_depth caps
    the suffix tree below the policy's own max_depth."""
    from arborspec.core.sampling import SamplingConfig
    from arborspec.drafting.base import DraftContext

    context = [5, 6, 7, 8, 9] * 4  # every suffix continues for many tokens
    deep = SuffixPolicy(max_depth=8).draft(DraftContext(None, context, SamplingConfig(0.0), None, 8))
    capped = SuffixPolicy(max_depth=8).draft(DraftContext(None, context, SamplingConfig(0.0), None, 2))
    assert max(deep.depths) > 2 and max(capped.depths) == 2


def test_suffix_options_take_their_bounds_inclusive():
    """min_match may equal max_match and be 0, store may be 0, factor and min_prob may be 0 and min_prob 1; one
    step past each bound is refused, naming the option."""
    for ok in ({"min_match": 4, "max_match": 4}, {"min_match": 0, "store": 0}, {"factor": 0.0, "min_prob": 0.0},
               {"min_prob": 1.0}, {"max_match": 1}):
        SuffixPolicy(**ok)
    for bad, name in (({"min_match": -1}, "min_match"), ({"store": -1}, "store"), ({"max_match": 0}, "max_match"),
                      ({"min_prob": 1.0000001}, "min_prob"), ({"factor": -1e-9}, "factor")):
        with pytest.raises(ValueError, match=f"^{name} must be"):
            SuffixPolicy(**bad)


def test_suffix_policy_explains_its_acceptance_over_what_it_drafted():
    from types import SimpleNamespace
    policy = SuffixPolicy()
    assert policy.explain()["acceptance_rate"] == 0.0  # nothing drafted yet
    steps = [SimpleNamespace(tree_size=5, accepted=2), SimpleNamespace(tree_size=3, accepted=1)]
    for step in steps:
        policy.update(step)
    got = policy.explain()
    assert got["steps"] == len(steps)
    assert got["acceptance_rate"] == sum(s.accepted for s in steps) / sum(s.tree_size for s in steps)


def test_a_short_max_match_still_drafts_as_deep_as_max_depth():
    from arborspec.core.sampling import SamplingConfig
    from arborspec.drafting.base import DraftContext

    context = [5, 6, 7, 8, 9] * 4  # every suffix continues for many tokens
    policy = SuffixPolicy(max_match=2, max_depth=6, factor=0.0)
    tree = policy.draft(DraftContext(None, context, SamplingConfig(0.0), None, 8))
    assert max(tree.depths) == 6


def test_suffix_policy_max_tree_depth_is_its_max_depth():
    assert SuffixPolicy(max_depth=5).max_tree_depth == 5


def test_suffix_policy_passes_factor_and_min_prob_to_its_speculation():
    from arborspec.core.sampling import SamplingConfig
    from arborspec.drafting.base import DraftContext

    context = [5, 6, 1, 2, 5, 6, 1, 3, 5, 6]  # "5 6" -> 1, then 2 or 3 (path prob 0.5 each)
    whole = SuffixIndex(8, 4)
    whole.follow(context)
    every = [c.token for c in whole.speculate(16, 4).nodes]
    for opts in ({"factor": 1.5}, {"factor": 0.0, "min_prob": 0.6}):
        ix = SuffixIndex(8, 4)
        ix.follow(context)
        want = [c.token for c in ix.speculate(16, 4, 1, opts["factor"], opts.get("min_prob", 0.0)).nodes]
        assert len(want) < len(every)  # the option cuts the tree
        tree = SuffixPolicy(max_match=8, max_depth=4, **opts).draft(
            DraftContext(None, context, SamplingConfig(0.0), None, 8))
        assert tree.tokens == [context[-1], *want]


def test_suffix_policy_drafts_at_most_its_budget():
    from arborspec.core.sampling import SamplingConfig
    from arborspec.drafting.base import DraftContext

    context = [5, 6, 7, 8, 9] * 4
    for budget in (1, 3):
        tree = SuffixPolicy(budget=budget, factor=0.0).draft(DraftContext(None, context, SamplingConfig(0.0), None, 8))
        assert len(tree) - 1 == budget  # the root is the last committed token


def test_a_speculation_trees_node_probs_are_each_tokens_own_count_ratio():
    ix = SuffixIndex(8, 4)
    ix.follow([5, 6, 1, 2, 5, 6, 1, 3, 5, 6])  # "5 6" -> 1 (prob 1), then 2 or 3 (prob 0.5, path prob 0.5)
    spec = ix.speculate(budget=10, max_depth=3)
    assert any(c.prob != c.path_prob for c in spec.nodes)  # a node below the first level's
    tree = speculation_tree(6, spec)
    assert tree.probs[1:] == [c.prob for c in spec.nodes] and tree.sources[1:] == ["suffix"] * len(spec.nodes)


def test_grafted_nodes_take_the_drafts_probability_where_it_has_one_and_score_their_path():
    context = [1, 2, 3, 5, 1, 2, 4, 7, 1, 2]  # "1 2" was followed by 3 5 and by 4 7
    ref = SuffixIndex(4, 4)
    ref.follow(context)
    spec = {c.token: c for c in ref.speculate(4).nodes}  # 3 and 4 (merged with the drafted ones), then 5 and 7
    assert spec[5].prob != spec[5].path_prob  # a count ratio of 1 below one of 1/2
    tree = TokenTree.from_parents([2, 3, 4], [-1, 0, 0])
    dist = [(i + 1) / 55 for i in range(10)]  # the draft's distribution below the drafted 3 (node 1), none below 4
    tree.child_dist[1] = dist
    scores = {}
    graft_suffix_branches(tree, SuffixIndex(4, 4), context, budget=4, scores=scores)
    assert tree.tokens == [2, 3, 4, 5, 7] and tree.parents == [-1, 0, 0, 1, 2]
    assert tree.probs[3] == pytest.approx(dist[5]) and tree.probs[4] == spec[7].prob
    assert scores == {3: spec[5].path_prob, 4: spec[7].path_prob}
    assert tree.also == {1: ["suffix"], 2: ["suffix"]}  # the drafted 3 and 4 were proposed by suffix too
    assert ref.speculate(4, min_prob=0.6).nodes == []  # every continuation of "1 2" has probability 1/2
    bare = TokenTree.from_parents([2, 3, 4], [-1, 0, 0])
    graft_suffix_branches(bare, SuffixIndex(4, 4), context, budget=4, min_prob=0.6)
    assert len(bare) == 3
