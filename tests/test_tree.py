import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from arborspec.core.tree import DrawRule, TokenTree, bfs_order, block_count, dfs_order, heavy_path_order, packed


@st.composite
def trees(draw, max_nodes=40):
    n = draw(st.integers(1, max_nodes))
    tree = TokenTree.root(draw(st.integers(0, 9)))
    for i in range(1, n):
        tree.add(draw(st.integers(0, i - 1)), draw(st.integers(0, 9)))
    return tree


def brute_ancestors(tree, i):
    out = {i}
    while tree.parents[i] >= 0:
        i = tree.parents[i]
        out.add(i)
    return out


@given(trees())
@settings(max_examples=60, deadline=None)
def test_mask_is_the_ancestor_relation(tree):
    mask = tree.ancestor_mask()
    for i in range(len(tree)):
        assert set(torch.nonzero(mask[i]).flatten().tolist()) == brute_ancestors(tree, i)
        assert tree.path(i)[0] == 0 and tree.path(i)[-1] == i and len(tree.path(i)) == tree.depths[i] + 1


@given(trees(), st.sampled_from(["bfs", "dfs", "heavy"]))
@settings(max_examples=60, deadline=None)
def test_packing_orders_keep_parents_first_and_the_same_paths(tree, order):
    out = packed(tree, order)
    out.validate()
    paths = sorted(tuple(tree.tokens[j] for j in tree.path(i)) for i in range(len(tree)))
    assert sorted(tuple(out.tokens[j] for j in out.path(i)) for i in range(len(out))) == paths


def test_orders_on_a_small_tree():
    #        0
    #      1   2
    #     3 4   5
    #           6
    tree = TokenTree.from_parents([0, 1, 2, 3, 4, 5, 6], [-1, 0, 0, 1, 1, 2, 5])
    assert bfs_order(tree) == [0, 1, 2, 3, 4, 5, 6]
    assert dfs_order(tree) == [0, 1, 3, 4, 2, 5, 6]
    assert heavy_path_order(tree) == [0, 1, 3, 4, 2, 5, 6]  # equal subtrees: storage order
    deep = TokenTree.from_parents([0, 1, 2, 3, 4], [-1, 0, 0, 2, 3])
    assert heavy_path_order(deep) == [0, 2, 3, 4, 1]  # the heavier child first
    assert tree.widths() == [1, 2, 3, 1]
    assert tree.position_ids(10).tolist() == [10, 11, 11, 12, 12, 12, 13]


def test_subtree_keeps_distributions_and_refuses_orphans():
    tree = TokenTree.from_parents([0, 1, 2, 3], [-1, 0, 0, 1])
    tree.set_children_dist(1, torch.tensor([0.5, 0.5]), DrawRule.WITH_REPLACEMENT)
    sub = tree.subtree([1, 3])
    assert sub.tokens == [0, 1, 3] and sub.parents == [-1, 0, 1]
    assert sub.child_rule == {1: DrawRule.WITH_REPLACEMENT}
    assert torch.equal(sub.child_dist[1], torch.tensor([0.5, 0.5]))  # what the verifiers read
    with pytest.raises(ValueError):
        tree.subtree([3])


def test_permute_refuses_child_before_parent():
    tree = TokenTree.from_parents([0, 1, 2], [-1, 0, 1])
    with pytest.raises(ValueError):
        tree.permute([0, 2, 1])


def test_block_count_counts_nonzero_tiles():
    chain = TokenTree.from_parents(list(range(64)), [-1] + list(range(63)))
    # a 64-token chain with no prefix is lower-triangular: 3 of 4 32x32 tiles are non-zero
    assert block_count(chain, prefix_len=0, block=32) == 3
    # a prefix of 32 adds one full column of tiles (2 rows)
    assert block_count(chain, prefix_len=32, block=32) == 5
    star = TokenTree.from_parents(list(range(64)), [-1] + [0] * 63)
    assert block_count(star, prefix_len=0, block=32) == 3  # column 0 in every row tile + the diagonal tiles
    # 40 nodes: a second, partial tile of rows and columns (rounded up, not down)
    assert block_count(chain.subtree(list(range(1, 40))), prefix_len=0, block=32) == 3


# ---- sources: who proposed each node -----------------------------------------------------------------------------
def test_sources_are_credited_to_the_first_proposer_and_counted_per_step():
    from arborspec.drafting.grafts.ngram import graft

    tree = TokenTree.root(1)
    a = tree.add(0, 2)  # the draft model's (the default source)
    tree.add(a, 3)
    graft(tree, [2, 4, 5])  # 2 is the draft's already; 4 and 5 are new
    chain = graft(tree, [2, 4, 6], source="suffix")
    assert tree.sources == ["", "draft", "draft", "ngram", "ngram", "suffix"]
    assert tree.also == {1: ["ngram", "suffix"], 3: ["suffix"]}
    counts = tree.by_source(chain[:2])  # accepted: 2 (draft's) and 4 (ngram's)
    assert counts == {"draft": {"proposed": 2, "accepted": 1, "also_accepted": 0},
                      "ngram": {"proposed": 2, "accepted": 1, "also_accepted": 1},
                      "suffix": {"proposed": 1, "accepted": 0, "also_accepted": 2}}
    assert sum(c["accepted"] for c in counts.values()) == 2
    assert sum(c["proposed"] for c in counts.values()) == len(tree) - 1
    tree.propose_again(1, "draft")  # its own source again, or a source already noted: no change
    tree.propose_again(1, "ngram")
    assert tree.also[1] == ["ngram", "suffix"]


@given(trees(), st.sampled_from(["bfs", "dfs", "heavy"]), st.randoms(use_true_random=False))
@settings(max_examples=40, deadline=None)
def test_reshaping_keeps_each_nodes_sources(tree, order, rnd):
    for i in range(1, len(tree)):
        tree.sources[i] = rnd.choice(["draft", "ngram", "suffix"])
        if rnd.random() < 0.3:
            tree.propose_again(i, "lookahead")
    out = packed(tree, order)
    where = {old: new for new, old in enumerate({"bfs": bfs_order, "dfs": dfs_order,
                                                 "heavy": heavy_path_order}[order](tree))}
    for old, new in where.items():
        assert out.sources[new] == tree.sources[old] and out.also.get(new) == tree.also.get(old)
    path = tree.path(len(tree) - 1)[1:]
    assert out.by_source([where[n] for n in path]) == tree.by_source(path)


def test_add_refuses_a_parent_outside_the_tree_and_leaves_it_unchanged():
    tree = TokenTree.from_parents([5, 6], [-1, 0])
    for parent in (2, -1):
        with pytest.raises(IndexError):
            tree.add(parent, 7)
    assert tree.tokens == [5, 6] and tree.parents == [-1, 0] and tree.depths == [0, 1]


def test_children_path_prob_and_rules_as_recorded():
    """children() finds the node right after its parent; path_prob multiplies the recorded draft probs; a rule given
    as a string is stored as a DrawRule, and an unknown one is refused."""
    tree = TokenTree.root(0)
    tree.add(0, 1, prob=0.5)
    tree.add(1, 2, prob=0.4)
    assert tree.children(0) == [1] and tree.children(1) == [2] and tree.children(2) == []
    assert tree.path_prob(2) == pytest.approx(0.2) and tree.path_prob(0) == 1.0
    tree.set_children_dist(0, torch.tensor([0.5, 0.5, 0.0]), "without_replacement")
    assert type(tree.child_rule[0]) is DrawRule
    with pytest.raises(ValueError):
        tree.set_children_dist(1, torch.tensor([1.0, 0.0, 0.0]), "bogus")


def test_the_root_is_never_proposed_again_and_also_accepted_counts_only_accepted_nodes():
    tree = TokenTree.root(0)
    a = tree.add(0, 1)
    b = tree.add(0, 2)
    tree.propose_again(0, "ngram")
    tree.propose_again(a, "ngram")
    tree.propose_again(b, "ngram")
    assert tree.also == {a: ["ngram"], b: ["ngram"]}
    assert tree.by_source([a])["ngram"] == {"proposed": 0, "accepted": 0, "also_accepted": 1}


@pytest.mark.parametrize("broken", ["root depth", "parent after child", "depth", "sampled, no dist"])
def test_validate_refuses_each_broken_invariant(broken):
    tree = TokenTree.from_parents([0, 1, 2], [-1, 0, 1])
    tree.validate()
    if broken == "root depth":  # every depth one more: only the root's is wrong
        tree.depths = [d + 1 for d in tree.depths]
    elif broken == "parent after child":
        tree.parents[1] = 2
    elif broken == "depth":
        tree.depths[2] = 1
    else:
        tree.child_rule[1] = DrawRule.WITH_REPLACEMENT
    with pytest.raises(ValueError):
        tree.validate()


def test_a_deterministic_node_needs_no_distribution():
    tree = TokenTree.from_parents([0, 1], [-1, 0])
    tree.child_rule[0] = DrawRule.DETERMINISTIC
    tree.validate()


def test_reshaping_refuses_bad_orders_and_subtree_keeps_storage_order():
    """permute needs a permutation (a repeated node is refused), packed a known order name; subtree keeps the kept
    nodes in storage order whatever order they are listed in (a set of 64, 1, 33 iterates otherwise)."""
    tree = TokenTree.from_parents(list(range(100)), [-1] + [0] * 99)
    with pytest.raises(ValueError):
        tree.permute([0, 1, 1] + list(range(3, 100)))
    with pytest.raises(ValueError):
        packed(tree, "zigzag")
    assert tree.subtree([64, 1, 33]).tokens == [0, 1, 33, 64]
