"""core/options.py: the checks every policy's options go through."""
from __future__ import annotations

import numpy as np
import pytest

from arborspec.core.options import check_int
from arborspec.drafting.chain import ChainOptions


@pytest.mark.parametrize("value", [1, 7, np.int64(3)])
def test_check_int_takes_integers_in_range(value):
    check_int(value, "k", low=1, high=8)


@pytest.mark.parametrize("value, message", [
    (2.0, "an integer"), (2.5, "an integer"), (True, "an integer"), ("3", "an integer"), (0, ">= 1"),
    (9, "at most 8"),
])
def test_check_int_refuses_floats_bools_text_and_values_out_of_range(value, message):
    with pytest.raises(ValueError, match=message):
        check_int(value, "k", low=1, high=8)


def test_a_policy_refuses_a_whole_float_for_an_integer_option():
    with pytest.raises(ValueError, match="k must be an integer"):
        ChainOptions(k=2.0)
