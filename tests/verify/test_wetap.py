"""WETAP's rule itself (verify/wetap.py), on trees small enough to work out by hand: the lossy verifier's tests
elsewhere check that it is refused without allow_lossy, flagged, and that its output drifts, which a wrong threshold
or a wrong choice among passing beams would not change."""
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
