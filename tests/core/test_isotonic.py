"""core/isotonic.py: pool adjacent violators, worked by hand."""
import numpy as np
import pytest

from arborspec.core.isotonic import pool_adjacent_violators


def test_a_pool_keeps_merging_backwards_with_its_summed_weight():
    """[2, 3, 0]: 3 and 0 pool to 1.5 (weight 2), which still breaks the order after 2: all three pool to 5/3."""
    assert pool_adjacent_violators([2, 3, 0]) == pytest.approx([5 / 3] * 3)
    assert pool_adjacent_violators([1, 2, 2, 3]).tolist() == [1, 2, 2, 3]


def test_pools_are_weighted_means():
    assert pool_adjacent_violators([2, 0], [3, 1]) == pytest.approx([1.5, 1.5])


def test_no_values_give_an_empty_fit():
    assert pool_adjacent_violators([]).shape == (0,) and isinstance(pool_adjacent_violators([1.0]), np.ndarray)
