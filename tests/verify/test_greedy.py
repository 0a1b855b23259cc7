"""Greedy verification: the longest path along the target's argmax, and a refusal to run at temperature > 0 (where
following the argmax would not preserve the target's distribution)."""
import pytest
import torch

from arborspec.core.sampling import SamplingConfig
from arborspec.core.tree import TokenTree
from arborspec.verify.greedy import GreedyVerifier


def tree_and_logits():
    """Root -> {1, 2}; node 2 -> {0}. The target's argmax: 2 at the root, 0 at node 2, 1 at node 3."""
    tree = TokenTree.root(0)
    tree.add(0, 1)
    two = tree.add(0, 2)
    tree.add(two, 0)
    logits = torch.tensor([[0.0, 1.0, 3.0], [5.0, 0.0, 0.0], [4.0, 0.0, 1.0], [0.0, 2.0, 1.0]])
    return tree, logits


def test_greedy_follows_the_target_argmax_and_adds_it_as_the_bonus():
    tree, logits = tree_and_logits()
    verdict = GreedyVerifier().verify(tree, logits, SamplingConfig(0.0), None)
    assert verdict.path == [2, 3] and verdict.bonus == 1


def test_greedy_refuses_a_temperature_above_zero():
    tree, logits = tree_and_logits()
    with pytest.raises(ValueError, match="temperature 0"):
        GreedyVerifier().verify(tree, logits, SamplingConfig(1.0), None)
