"""core/options.py: the checks every policy's options go through."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from arborspec.core.options import (
    check_bool,
    check_int,
    check_numbers,
    int_or_text,
    opt,
    option_parser,
    parse_bool,
    parse_float_list,
    parse_int_list,
)
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


@dataclasses.dataclass
class Opts:
    budget: int = opt(8, "nodes")
    k: int = opt(2, "children")
    tau: float = opt(0.5, "threshold")
    name: str = opt("x", "a name")
    mixed: int | str = opt(1, "a count or a word")
    widths: list[int] = opt(None, "a list, parsed as text")
    adapt: bool = opt(True, "a flag")


def test_check_int_bounds_are_inclusive_and_low_defaults_to_one():
    check_int(8, "k", low=1, high=8)
    with pytest.raises(ValueError, match=">= 1"):
        check_int(0, "k")


def test_check_numbers_refuses_bools_and_text_for_float_fields_only():
    check_numbers(Opts, {"tau": 1, "k": True, "name": "abc"})
    for value in (True, "0.9"):
        with pytest.raises(ValueError, match="tau must be a number"):
            check_numbers(Opts, {"tau": value})


def test_bools_from_python_and_from_text():
    """check_bool takes bools and 0 / 1, not 2; parse_bool reads the words either way, case and spaces aside."""
    assert check_bool(1, "f") is True and check_bool(False, "f") is False
    with pytest.raises(ValueError):
        check_bool(2, "f")
    assert parse_bool(" Yes ", "f") is True and parse_bool("no", "f") is False and parse_bool("ON", "f") is True
    with pytest.raises(ValueError, match="f must be true or false"):
        parse_bool("maybe", "f")


def test_option_parsers_follow_each_fields_annotation():
    """budget always takes a word (auto); an int field parses to int, a float one to float, an unknown type is kept
    as text; a bad value names the field and what it takes."""
    parse = {f.name: option_parser(f) for f in dataclasses.fields(Opts)}
    assert parse["budget"]("auto") == "auto" and parse["budget"]("5") == 5
    assert type(parse["k"]("3")) is int and parse["tau"]("0.25") == 0.25 and parse["name"]("abc") == "abc"
    assert parse["mixed"]("auto") == "auto" and parse["mixed"]("4") == 4 and parse["widths"]("1,2") == "1,2"
    assert parse["adapt"]("off") is False
    with pytest.raises(ValueError, match="k takes an integer"):
        parse["k"]("x")
    with pytest.raises(ValueError, match="tau takes a number"):
        parse["tau"]("x")
    assert int_or_text("auto") == "auto" and dataclasses.fields(Opts)[1].metadata["help"] == "children"


def test_number_lists():
    """Floats: empty items skipped, zero allowed, negatives and nothing refused. Integers: positive, no empty item."""
    assert parse_float_list("0.7,,1.0", "t") == [0.7, 1.0] and parse_float_list("0", "t") == [0.0]
    for text in ("", "-1", "a"):
        with pytest.raises(ValueError):
            parse_float_list(text, "t")
    assert parse_int_list("3,2", "w") == (3, 2)
    for text in ("3,0", "3,,3", "x"):
        with pytest.raises(ValueError):
            parse_int_list(text, "w")
