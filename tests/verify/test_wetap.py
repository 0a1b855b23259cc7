"""WETAP's rule itself (verify/wetap.py), on trees small enough to work out by hand: the lossy verifier's tests
elsewhere check that it is refused without allow_lossy, flagged, and that its output drifts, which a wrong threshold
or a wrong choice among passing beams would not change."""
import pytest
import torch

from arborspec.core.sampling import SamplingConfig, make_generator
from arborspec.core.tree import DrawRule, TokenTree
from arborspec.verify.wetap import WETAPVerifier


def one_layer(children: list[int], q: list[float], p_root: list[float]) -> tuple[TokenTree, torch.Tensor]:
    """A root with `children` drawn from q; the target's rows: p_root at the root, uniform below (4 tokens)."""
    tree = TokenTree.root(0)
    for token in children:
        tree.add(0, token)
    tree.set_children_dist(0, torch.tensor(q), DrawRule.WITHOUT_REPLACEMENT)
    rows = [p_root] + [[0.25] * 4] * len(children)
    return tree, torch.log(torch.tensor(rows))  # (1 + children, 4) logits whose softmax at T = 1 is the rows


def test_among_passing_beams_the_highest_target_probability_wins():
    """Children 2 and 1 both pass (ratios 0.75 and 1 > tau): the one the target likes more (p 0.5 against 0.3) is
    kept, wherever it sits among the children."""
    tree, logits = one_layer([2, 1], q=[0.1, 0.4, 0.4, 0.1], p_root=[0.1, 0.5, 0.3, 0.1])
    verdict = WETAPVerifier().verify(tree, logits, SamplingConfig(1.0), make_generator(0))
    assert verdict.path == [2]  # node 2 holds token 1


def test_the_default_threshold_is_one_half():
    """A beam at ratio 0.4 (p 0.2 over q 0.5) fails the default tau 0.5 and passes tau 0.3; one at 0.6 passes it."""
    tree, logits = one_layer([3], q=[0.2, 0.2, 0.1, 0.5], p_root=[0.3, 0.3, 0.2, 0.2])
    assert WETAPVerifier().verify(tree, logits, SamplingConfig(1.0), make_generator(0)).path == []
    assert WETAPVerifier(0.3).verify(tree, logits, SamplingConfig(1.0), make_generator(0)).path == [1]
    tree, logits = one_layer([3], q=[0.2, 0.2, 0.1, 0.5], p_root=[0.2, 0.3, 0.2, 0.3])
    assert WETAPVerifier().verify(tree, logits, SamplingConfig(1.0), make_generator(0)).path == [1]


def test_tau_must_lie_in_zero_to_one():
    """0 is allowed (any positive ratio passes), 1 is not (no ratio exceeds it), nor is a negative tau."""
    assert WETAPVerifier(0.0).tau == 0.0
    for tau in (1.0, -0.1):
        with pytest.raises(ValueError):
            WETAPVerifier(tau)


def test_a_beam_passes_on_its_products_and_the_deepest_layer_wins():
    """Chain root -> token 1 -> token 2. Token 2 alone fails (p 0.3 over q 0.5), but its path passes:
    (0.5 * 0.3) / (0.25 * 0.5) = 1.2 > tau. Token 1 passes too (0.5 / 0.25), and the deeper beam wins."""
    tree = TokenTree.root(0)
    tree.add(0, 1)
    tree.add(1, 2)
    tree.set_children_dist(0, torch.tensor([0.25] * 4), DrawRule.WITHOUT_REPLACEMENT)
    tree.set_children_dist(1, torch.tensor([0.1, 0.1, 0.5, 0.3]), DrawRule.WITHOUT_REPLACEMENT)
    logits = torch.log(torch.tensor([[0.1, 0.5, 0.3, 0.1], [0.2, 0.2, 0.3, 0.3], [0.25] * 4]))
    assert WETAPVerifier().verify(tree, logits, SamplingConfig(1.0), make_generator(0)).path == [1, 2]


def test_zero_guards():
    """A child the draft gave q = 0 but the target p > 0 has ratio inf and passes; one the target gives p = 0 has
    ratio 0 and fails even tau = 0."""
    tree, logits = one_layer([2], q=[0.5, 0.5, 0.0, 0.0], p_root=[0.4, 0.4, 0.1, 0.1])
    assert WETAPVerifier(0.9).verify(tree, logits, SamplingConfig(1.0), make_generator(0)).path == [1]
    tree, logits = one_layer([3], q=[0.2, 0.2, 0.1, 0.5], p_root=[0.5, 0.5, 0.0, 0.0])
    assert WETAPVerifier(0.0).verify(tree, logits, SamplingConfig(1.0), make_generator(0)).path == []
