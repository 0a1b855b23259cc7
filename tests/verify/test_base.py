"""verify/base.py's helpers, directly: which trees a verifier fits, and the refusals and conversions the verifiers
share.

- `fits`: a chain widens a sampled rule to every one-draw rule, but never a rule that accepts no sampled draw
  (deterministic children stay deterministic).
- `chain_nodes` refuses a node with two children; `draft_dist` refuses a node whose distribution was not recorded,
  and returns float64.
- A chain rule's `expected_accepted` on a bare root (nothing drafted) is 0.
"""
import pytest
import torch

from arborspec.core.tree import DrawRule, TokenTree
from arborspec.verify import VERIFIERS
from arborspec.verify.base import SAMPLED, Verifier, chain_nodes, draft_dist, fits

W, WO, G, DET = (DrawRule.WITH_REPLACEMENT, DrawRule.WITHOUT_REPLACEMENT, DrawRule.GREEDY_TOPK_PLUS_ONE,
                 DrawRule.DETERMINISTIC)


class OnlyDeterministic(Verifier):
    accepts = frozenset({DET})


class OnlySampled(Verifier):
    accepts = SAMPLED


def test_a_chain_widens_only_a_rule_that_accepts_a_sampled_draw():
    """A chain's single child is one draw for a sampled rule (so greedy top-k plus one fits it), but a rule exact only
    for deterministic children gains nothing from the tree being a chain."""
    assert fits(OnlySampled, {G}, chain=True) and not fits(OnlySampled, {G}, chain=False)
    assert not fits(OnlyDeterministic, {W}, chain=True)
    assert not fits(OnlyDeterministic, {G}, chain=True)
    assert fits(OnlyDeterministic, {DET}, chain=True)


def test_chain_nodes_refuses_a_node_with_two_children():
    tree = TokenTree.root(0)
    tree.add(0, 1)
    tree.add(1, 2)
    assert chain_nodes(tree, "sps") == [0, 1, 2]
    tree.add(1, 3)
    with pytest.raises(ValueError, match="node 1 has 2 children"):
        chain_nodes(tree, "sps")


def test_draft_dist_refuses_a_missing_distribution_and_returns_float64():
    tree = TokenTree.root(0)
    tree.add(0, 1)
    with pytest.raises(ValueError, match="node 0's children"):
        draft_dist(tree, 0, "mbr")
    tree.set_children_dist(0, torch.tensor([0.25, 0.75], dtype=torch.float32), WO)
    got = draft_dist(tree, 0, "mbr")
    assert got.dtype == torch.float64 and got.tolist() == [0.25, 0.75]


@pytest.mark.parametrize("name", ["sps", "asps", "block"])
def test_a_chain_rule_expects_nothing_accepted_when_nothing_was_drafted(name):
    P = torch.tensor([[0.5, 0.5]], dtype=torch.float64)
    assert VERIFIERS[name]().expected_accepted(TokenTree.root(0), P) == 0.0
