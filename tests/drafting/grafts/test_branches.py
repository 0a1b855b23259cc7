"""The free branches together (drafting/grafts/branches.py): however many nodes each source may add, a step's tree
stays within MAX_TREE_NODES drafted nodes, and sizes that could never fit are refused up front."""
from types import SimpleNamespace

import pytest

from arborspec.core.tree import MAX_TREE_NODES, TokenTree
from arborspec.drafting.grafts import FreeBranches
from arborspec.runspec import parse


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


@pytest.mark.parametrize("method,says", [
    ("chain+lookahead1000x1000", "= 1998000 tokens a step; a step's tree may hold at most 1024"),  # ~1M rows a step
    ("chain+suffix5000", "suffix must be at most 1024"),
    ("suffix(budget=5000)", "budget must be at most 1024"),
    ("suffix(max_depth=5000)", "max_depth must be at most 1024"),
])
def test_branch_sizes_past_the_node_bound_are_refused_as_the_name_is_read(method, says):
    with pytest.raises(ValueError, match=f"method '.*': .*{says}"):
        parse(method)
