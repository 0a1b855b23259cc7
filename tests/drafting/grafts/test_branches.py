"""The free branches together (drafting/grafts/branches.py): however many nodes each source may add, a step's tree
stays within MAX_TREE_NODES drafted nodes, and sizes that could never fit are refused up front."""
from types import SimpleNamespace

import pytest

from arborspec.core.tree import MAX_TREE_NODES, TokenTree
from arborspec.drafting.auto.objective import CostModel
from arborspec.drafting.grafts import FreeBranches
from arborspec.runspec import parse
from arborspec.tuning.costs import CostCurve


def test_the_grafts_fill_a_step_up_to_the_node_bound_and_no_further():
    """A 1000-node drafted tree with a 1024-node suffix branch (and n-gram, lookahead) made a 2000-node step: past
    the tree room a llama.cpp context keeps at its window's end (backends/llamacpp.py, `region`)."""
    branches = FreeBranches("static", ngram=2, ngram_len=16, suffix=MAX_TREE_NODES, lookahead=4)
    run = branches.start(SimpleNamespace(estimate=lambda: None))  # a policy without costs keeps every branch
    context = list(range(2, 50)) * 40  # every suffix and n-gram has an earlier match to copy
    for drafted in (1000, 100):
        tree = TokenTree.root(context[-1])
        for i in range(drafted):
            tree.add(0 if i < 8 else 1 + (i - 8) % 8, 60 + i % 4)
        out = run.graft(tree, context, room=4000)
        assert drafted + 16 < len(out) - 1 <= MAX_TREE_NODES  # the n-gram's 16 tokens, and more
        assert {"ngram", "lookahead"} <= set(out.sources)
    assert out.sources.count("suffix") > 800  # with room left, the suffix branch is hundreds of nodes


KEEP_ALL = SimpleNamespace(estimate=lambda: None)  # a policy without costs: every branch is kept
CONTEXT = list(range(2, 50)) * 40  # the last n-gram (48 49) was followed by 2 3 4 ... before


def drafted_tree(nodes: int) -> TokenTree:
    """A drafted tree of `nodes` nodes whose tokens (60..63) no free branch proposes."""
    tree = TokenTree.root(CONTEXT[-1])
    for i in range(nodes):
        tree.add(0 if i < 8 else 1 + (i - 8) % 8, 60 + i % 4)
    return tree


def test_the_node_bound_is_filled_exactly_and_each_source_stops_at_it():
    """Four nodes short of MAX_TREE_NODES, the n-gram branch (16 asked) takes exactly those four, and the lookahead
    window (4 nodes) no longer fits: the step holds MAX_TREE_NODES drafted nodes, not one more or one fewer."""
    run = FreeBranches("static", ngram=2, ngram_len=16, suffix=0, lookahead=4).start(KEEP_ALL)
    out = run.graft(drafted_tree(MAX_TREE_NODES - 4), CONTEXT, room=4000)
    assert len(out) - 1 == MAX_TREE_NODES and out.sources.count("ngram") == 4 and "lookahead" not in out.sources
    assert out.tokens[-4:] == [2, 3, 4, 5]


def test_the_free_branches_are_no_deeper_than_the_room():
    """With room 3, the n-gram branch (16 asked) stops at depth 3, and a window that needs exactly depth 3 (3 wide,
    one level) is grafted."""
    run = FreeBranches("static", ngram=2, ngram_len=16, suffix=0, lookahead=3).start(KEEP_ALL)
    out = run.graft(TokenTree.root(CONTEXT[-1]), CONTEXT, room=3)
    assert out.sources.count("ngram") == 3 and out.sources.count("lookahead") == 3 and max(out.depths) == 3


def test_ngram_len_must_be_positive_when_ngram_branches_are_asked():
    """ngram_len 0 would graft nothing while the caller asked for n-gram branches: refused (accepted without them)."""
    with pytest.raises(ValueError, match="ngram_len must be an integer >= 1"):
        FreeBranches("static", ngram=2, ngram_len=0)
    assert not FreeBranches("static", ngram=0, ngram_len=0, suffix=0)


def test_each_generation_gets_its_own_window_and_budget():
    """Generations of one decoder may run at once (a batching round's threads): `start` gives each its own lookahead
    window and budget, and leaves the decoder's object without either."""
    branches = FreeBranches("static", lookahead=2)
    one, two = branches.start(KEEP_ALL), branches.start(KEEP_ALL)
    assert one.window is not two.window and one.budget is not two.budget and one.policy is KEEP_ALL
    assert branches.window is None and branches.budget is None and branches.policy is None


def test_settle_judges_a_left_out_branch_by_the_committed_tokens():
    """Under steep costs a measured, poor n-gram source is left out; the tokens committed after its step still count
    its nodes as proposed and, where they match, accepted (so a source that starts to fit comes back)."""
    steep = CostCurve.from_measurements([1, 2, 4, 8, 16], [0.05 * n for n in (1, 2, 4, 8, 16)])
    run = FreeBranches("static", ngram=2, ngram_len=3, suffix=0).start(
        SimpleNamespace(costs=CostModel(steep, steep), estimate=lambda: [1.0, 0.05]))
    run.settle({"ngram": {"proposed": 40, "accepted": 0}}, [])
    out = run.graft(TokenTree.root(CONTEXT[-1]), CONTEXT, room=8)
    assert len(out) == 1 and run.describe()["ngram"]["dropped"] == 1  # the branch 2 3 4 was left out
    run.settle({}, [2, 3, 9])
    assert run.describe()["ngram"]["proposed"] == 43 and run.describe()["ngram"]["accepted"] == 2


def test_the_suffix_branch_is_cut_by_its_scores_from_the_first_step():
    """The suffix source hands the budget its nodes' path probabilities, so a 16-node copy is cut to the prefix the
    prior pays for at once (unscored, it would be kept whole during a warm-up)."""
    sizes = [1, 2, 4, 8, 16, 32]
    rows = CostCurve.from_measurements(sizes, [0.05 + 0.02 * (n - 1) for n in sizes])
    run = FreeBranches("static", suffix=16).start(SimpleNamespace(costs=CostModel(rows, rows),
                                                                  estimate=lambda: [1.0, 0.05]))
    out = run.graft(TokenTree.root(CONTEXT[-1]), CONTEXT, room=64)
    assert 1 <= out.sources.count("suffix") < 16 and out.tokens[1] == 2


@pytest.mark.parametrize("method,says", [
    ("chain+lookahead1000x1000", "= 1998000 tokens a step; a step's tree may hold at most 1024"),  # ~1M rows a step
    ("chain+suffix5000", "suffix must be at most 1024"),
    ("suffix(budget=5000)", "budget must be at most 1024"),
    ("suffix(max_depth=5000)", "max_depth must be at most 1024"),
])
def test_branch_sizes_past_the_node_bound_are_refused_as_the_name_is_read(method, says):
    with pytest.raises(ValueError, match=f"method '.*': .*{says}"):
        parse(method)
