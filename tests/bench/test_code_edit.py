"""The code-edit set's edits: only the edited lines change, the reference is the right answer, the code still runs."""
import ast

import pytest

from arborspec.bench import code_edit, datasets
from arborspec.bench.code_edit import EDITS, make_edit

PROGRAM = '''from typing import List


def helper(numbers):
    return [n + 1 for n in numbers]


def total(numbers: List[int], start: int = 0) -> int:
    """ Sum of numbers, plus start.
    >>> total([1, 2], 1)
    4
    """
    acc = start  # keep comments
    for n in numbers:
        acc += n
    return acc + 0 * len(dict(numbers=numbers))
'''


def run(code: str, *args):
    scope = {}
    exec(compile(code, "<edit>", "exec"), scope)
    return scope["total"](*args)


def changed_lines(a: str, b: str) -> list[tuple[str, str]]:
    return [(x, y) for x, y in zip(a.splitlines(), b.splitlines()) if x != y]


def test_edits_take_turns_by_task_index():
    assert [make_edit(PROGRAM, "total", i).kind for i in range(6)] == list(EDITS) * 2
    assert make_edit(PROGRAM, "total", 4) == make_edit(PROGRAM, "total", 1)  # a function of text and index only


def test_rename_changes_the_parameter_and_its_uses_only():
    edit = make_edit(PROGRAM, "total", 0)
    assert edit.code == PROGRAM and "`numbers`" in edit.instruction and "`input_numbers`" in edit.instruction
    assert changed_lines(PROGRAM, edit.reference) == [
        ("def total(numbers: List[int], start: int = 0) -> int:",
         "def total(input_numbers: List[int], start: int = 0) -> int:"),
        ("    for n in numbers:", "    for n in input_numbers:"),
        ("    return acc + 0 * len(dict(numbers=numbers))", "    return acc + 0 * len(dict(numbers=input_numbers))"),
    ]  # the helper's own parameter, the docstring and the keyword argument keep the name
    assert run(edit.reference, [1, 2], 1) == run(PROGRAM, [1, 2], 1) == 4


def test_rename_avoids_taken_names_and_falls_back_where_tokens_miss_a_use():
    taken = PROGRAM.replace("acc = start", "input_numbers = acc = start")
    assert "`input_numbers1`" in make_edit(taken, "total", 0).instruction
    fstring = PROGRAM.replace("    return acc", '    print(f"{numbers}")\n    return acc')
    assert make_edit(fstring, "total", 0).kind == "docstring"  # renaming by tokens would miss the f-string's use
    assert make_edit("def f():\n    return 1\n", "f", 0).kind == "docstring"  # nothing to rename


def test_docstring_edit_removes_exactly_the_docstring():
    edit = make_edit(PROGRAM, "total", 1)
    assert '"""' not in edit.code and edit.reference == PROGRAM
    kept = [line for line in PROGRAM.splitlines(keepends=True) if line not in edit.code.splitlines(keepends=True)]
    assert "".join(kept).strip().startswith('""" Sum of numbers') and len(kept) == 4
    assert run(edit.code, [1, 2], 1) == 4
    assert make_edit("def f(x):\n    return x\n", "f", 1).reference is None  # no docstring to take out


def test_hints_edit_strips_the_signature_only():
    edit = make_edit(PROGRAM, "total", 2)
    assert changed_lines(PROGRAM, edit.code) == [("def total(numbers: List[int], start: int = 0) -> int:",
                                                  "def total(numbers, start=0):")]
    assert edit.reference == PROGRAM and run(edit.code, [1, 2], 1) == 4
    multi = "def g(a: int,\n      b: str = ':',\n      *rest: int, key: dict = {1: 2}, **kw) -> bool: return True\n"
    edit = make_edit(multi, "g", 2)
    assert edit.code == "def g(a, b=':', *rest, key={1: 2}, **kw): return True\n"
    assert make_edit("def f(x):\n    return x\n", "f", 2).reference is None  # it had no hints to restore


def test_the_request_shows_the_code_in_a_block():
    edit = make_edit(PROGRAM, "total", 2)
    assert edit.request.startswith(edit.instruction) and f"```python\n{edit.code}```" in edit.request


def test_bad_programs_say_what_is_wrong():
    with pytest.raises(ValueError, match="no top-level function 'missing'"):
        make_edit(PROGRAM, "missing", 0)
    with pytest.raises(ValueError, match="does not parse"):
        make_edit("def f(:\n", "f", 0)


@pytest.mark.skipif(not datasets.dataset_path(datasets.SOURCES["humaneval"]).exists(),
                    reason="HumanEval is not in the cache (arborspec bench --dataset humaneval fetches it)")
def test_every_humaneval_task_makes_a_valid_edit():
    path = datasets.dataset_path(datasets.SOURCES["humaneval"])
    kinds = []
    for i, task in enumerate(datasets._humaneval_tasks(path)):
        source = task["prompt"] + task["canonical_solution"]
        edit = make_edit(source, task["entry_point"], i)
        kinds.append(edit.kind)
        ast.parse(edit.code)
        assert edit.reference is None or ast.parse(edit.reference)
        if edit.kind != "rename" and edit.reference is not None:  # the answer repeats the input, line for line
            missing = [line for line in edit.code.splitlines() if line not in edit.reference.splitlines()]
            assert len(missing) == (edit.kind == "hints"), missing  # hints: only the bare signature line is new
    assert len(kinds) == 164 and kinds.count("rename") >= 50 and kinds.count("hints") >= 50
    assert code_edit.EDITS == ("rename", "docstring", "hints")
