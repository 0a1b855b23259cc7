"""Parsing the options a user writes as text (`dynatree(adapt=false)`, `--widths 3,3,3`): checked integers,
booleans, integer lists, and the dataclass fields a policy declares its options with (`opt`)."""
from __future__ import annotations

import dataclasses
import numbers


def is_whole(value) -> bool:
    """An integer of any kind (Python's, numpy's), not a bool and not a float that happens to be whole: what the
    engine takes for a token id, a token budget or a seed (2.0 as max_new_tokens crashed the chain policy)."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def check_int(value, what: str, low: int = 1, high: int | None = None) -> None:
    """ValueError unless `value` is an integer (is_whole: not 2.0, which the policies passed on to range()) in
    [low, high]."""
    if not is_whole(value) or value < low:
        raise ValueError(f"{what} must be an integer >= {low}, got {value!r}")
    if high is not None and value > high:
        raise ValueError(f"{what} must be at most {high}, got {value!r}")


def check_numbers(options_class, values: dict) -> None:
    """ValueError naming the first of `values` given to a float field of `options_class` (a policy's Options) that is
    not a number: `tau_h="0.9"` failed inside a range check as "'<' not supported between instances of 'float' and
    'str'", and `factor=True` ran as 1."""
    floats = {f.name for f in dataclasses.fields(options_class) if getattr(f.type, "__name__", f.type) == "float"}
    for name, value in values.items():
        if name in floats and (isinstance(value, bool) or not isinstance(value, numbers.Real)):
            raise ValueError(f"{name} must be a number, got {value!r}")


def check_bool(value, what: str) -> bool:
    """`value` if it is a bool (or 0 / 1); ValueError otherwise: the text "no" is true to Python."""
    if isinstance(value, bool) or (is_whole(value) and value in (0, 1)):
        return bool(value)
    raise ValueError(f"{what} must be true or false, got {value!r}")


def parse_bool(value, what: str) -> bool:
    """Options arrive as Python bools or, from the command line, as text."""
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in {"1", "true", "yes", "on"}:
        return True
    if text in {"0", "false", "no", "off"}:
        return False
    raise ValueError(f"{what} must be true or false, got {value!r}")


def int_or_text(text: str):
    """An integer option that also takes a word (dyspec's budget=auto)."""
    try:
        return int(text)
    except ValueError:
        return text


def option_parser(f: dataclasses.Field):
    """The function turning a command-line string into the value of option field `f` (by its annotation)."""
    if f.name == "budget":  # every policy's budget also takes "auto" (drafting/budget_tuner.py)
        return int_or_text
    kind = getattr(f.type, "__name__", f.type)
    if kind == "bool":
        return lambda text: parse_bool(text, f.name)
    convert = {"int": int, "float": float, "str": str, "int | str": int_or_text}.get(kind, str)

    def parse(text: str):
        try:
            return convert(text)
        except ValueError:
            raise ValueError(f"{f.name} takes {'an integer' if kind == 'int' else 'a number'}, got {text!r}") from None
    return parse


def opt(default, help: str):
    """A policy option: a dataclass field whose help text the CLI shows."""
    return dataclasses.field(default=default, metadata={"help": help})


def parse_float_list(text: str, what: str) -> list[float]:
    """Comma-separated non-negative numbers (temperatures, top-p values); empty items are skipped."""
    try:
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"{what} must be comma-separated numbers, got {text!r}") from None
    if not values or any(v < 0 for v in values):
        raise ValueError(f"{what} must list non-negative numbers, got {text!r}")
    return values


def parse_int_list(text: str, what: str) -> tuple[int, ...]:
    try:
        values = tuple(int(x) for x in str(text).split(","))  # an empty item ("3,,3") is refused, not skipped
    except ValueError:
        raise ValueError(f"{what} must be a comma-separated list of integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise ValueError(f"{what} must list positive integers, got {text!r}")
    return values
