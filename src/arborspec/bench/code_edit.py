"""The `code-edit` prompt set's edits: a small complete program and one change to make, so the answer repeats the input.

Draft-free drafts (suffix statistics, prompt lookup, lookahead) pay most where the output copies the input, as when
code is edited (SuffixDecoding's agent and edit workloads). HumanEval ships offline and each task's prompt plus its
canonical solution is a small complete program; each is shown with one edit to make, chosen by the task's index in
turn so that any first N prompts mix all three:

- `rename`: rename the entry point's first parameter (to `input_<name>`) wherever the code uses it;
- `docstring`: the entry point's docstring is taken out of the code shown, and the task is to write one;
- `hints`: the entry point's parameter and return annotations are taken out, and the task is to add type hints.

Only those lines of the task's own text change (formatting and comments are kept, no `ast.unparse`; blank lines
around the program are dropped), so the expected answer is the shown code with a few lines changed or added.
`reference` is that answer where the task's text gives it: the renamed code; the original code for `docstring` and,
when it had annotations, for `hints`. Everything is a function of the task's text and index: no randomness.
"""
from __future__ import annotations

import ast
import io
import tokenize
from dataclasses import dataclass

EDITS = ("rename", "docstring", "hints")
ASK = "Reply with the whole code, edited, in one ```python code block."


@dataclass
class CodeEdit:
    kind: str  # one of EDITS
    instruction: str
    code: str  # the program as the prompt shows it
    reference: str | None  # the expected answer's code, where the task's own text gives it

    @property
    def request(self) -> str:
        """The user turn: the instruction, then the code in a fenced block."""
        return f"{self.instruction} {ASK}\n\n```python\n{self.code}```\n"


def make_edit(source: str, entry_point: str, index: int) -> CodeEdit:
    """Edit number `index` (EDITS in turn) of the program `source` whose main function is `entry_point`."""
    source = source.lstrip("\n").rstrip("\n") + "\n"  # no blank lines around the program
    fn = find_function(source, entry_point)
    kind = EDITS[index % len(EDITS)]
    edit = {"rename": rename, "docstring": drop_docstring, "hints": drop_hints}[kind](source, fn)
    return edit if edit is not None else drop_docstring(source, fn)  # a function without parameters to rename


def find_function(source: str, name: str) -> ast.FunctionDef:
    try:
        tree = ast.parse(source)
    except SyntaxError as err:
        raise ValueError(f"the task's code does not parse: {err}") from None
    found = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == name]
    if not found:
        raise ValueError(f"the task's code defines no top-level function {name!r}")
    return found[-1]


# ---- docstring -----------------------------------------------------------------------------------------------------
def drop_docstring(source: str, fn: ast.FunctionDef) -> CodeEdit:
    """The code without `fn`'s docstring lines; the task is to write one."""
    doc = fn.body[0]
    has_doc = (isinstance(doc, ast.Expr) and isinstance(doc.value, ast.Constant) and isinstance(doc.value.value, str)
               and doc.lineno > fn.lineno and len(fn.body) > 1)  # on lines of its own, and not the whole body
    lines = source.splitlines(keepends=True)
    code = "".join(lines[: doc.lineno - 1] + lines[doc.end_lineno:]) if has_doc else source
    instruction = (f"Add a docstring to the function `{fn.name}`: what it does, its parameters, what it returns, "
                   "and an example.")
    return CodeEdit("docstring", instruction, code, source if has_doc else None)


# ---- type hints ----------------------------------------------------------------------------------------------------
def drop_hints(source: str, fn: ast.FunctionDef) -> CodeEdit:
    """The code with `fn`'s signature rewritten without annotations; the task is to add type hints."""
    bare = ast.arguments(**{f: getattr(fn.args, f) for f in fn.args._fields})  # defaults kept
    strip = lambda a: ast.arg(arg=a.arg, annotation=None) if a is not None else None  # noqa: E731
    for group in ("posonlyargs", "args", "kwonlyargs"):
        setattr(bare, group, [strip(a) for a in getattr(fn.args, group)])
    bare.vararg, bare.kwarg = strip(fn.args.vararg), strip(fn.args.kwarg)
    every = [*fn.args.posonlyargs, *fn.args.args, *fn.args.kwonlyargs, fn.args.vararg, fn.args.kwarg]
    annotated = fn.returns is not None or any(a is not None and a.annotation is not None for a in every)
    row, col = signature_colon(source, fn)
    lines = source.splitlines(keepends=True)
    head = lines[fn.lineno - 1][: fn.col_offset]
    tail = lines[row - 1][col + 1:]
    code = "".join(lines[: fn.lineno - 1] + [f"{head}def {fn.name}({ast.unparse(bare)}):{tail}"] + lines[row:])
    instruction = f"Add type hints to the parameters and the return value of the function `{fn.name}`."
    return CodeEdit("hints", instruction, code, source if annotated else None)


def signature_colon(source: str, fn: ast.FunctionDef) -> tuple[int, int]:
    """(row, column) of the colon that ends `fn`'s signature: the first ':' outside brackets after its `def`."""
    depth = 0
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.start[0] < fn.lineno or (tok.start[0] == fn.lineno and tok.start[1] < fn.col_offset):
            continue
        if tok.type == tokenize.OP:
            depth += (tok.string in "([{") - (tok.string in ")]}")
            if tok.string == ":" and depth == 0:
                return tok.start
    raise ValueError(f"no end of the signature of {fn.name!r}")


# ---- rename --------------------------------------------------------------------------------------------------------
def rename(source: str, fn: ast.FunctionDef) -> CodeEdit | None:
    """Rename `fn`'s first parameter wherever `fn` uses it (names only: strings and the docstring keep the old name);
    None when `fn` has no parameter, or when renaming by tokens would miss a use (a name inside an f-string)."""
    params = [*fn.args.posonlyargs, *fn.args.args, *fn.args.kwonlyargs]
    if not params:
        return None
    old = params[0].arg
    names = {tok.string for tok in tokens(source) if tok.type == tokenize.NAME}
    new, i = f"input_{old}", 1
    while new in names:  # a name the program already uses
        new, i = f"input_{old}{i}", i + 1
    code = replace_name(source, fn, old, new)
    if any(isinstance(n, ast.Name) and n.id == old for n in ast.walk(find_function(code, fn.name))):
        return None
    instruction = f"Rename the parameter `{old}` of the function `{fn.name}` to `{new}` everywhere the code uses it."
    return CodeEdit("rename", instruction, source, code)


def tokens(source: str) -> list[tokenize.TokenInfo]:
    return list(tokenize.generate_tokens(io.StringIO(source).readline))


def replace_name(source: str, fn: ast.FunctionDef, old: str, new: str) -> str:
    """`source` with the name `old` replaced by `new` inside `fn`'s lines, except attributes (`x.old`) and keyword
    arguments of calls in its body (`f(old=...)`)."""
    toks = tokens(source)
    sig_end = signature_colon(source, fn)[0]
    hits, depth = [], 0
    for i, tok in enumerate(toks):
        if tok.type == tokenize.OP:
            depth += (tok.string in "([{") - (tok.string in ")]}")
        if not (fn.lineno <= tok.start[0] <= fn.end_lineno and tok.type == tokenize.NAME and tok.string == old):
            continue
        after = toks[i + 1].string if i + 1 < len(toks) else ""
        keyword_arg = depth > 0 and after == "=" and tok.start[0] > sig_end
        if toks[i - 1].string != "." and not keyword_arg:
            hits.append(tok.start)
    lines = source.splitlines(keepends=True)
    for row, col in reversed(hits):  # right to left, so earlier columns stay valid
        line = lines[row - 1]
        lines[row - 1] = line[:col] + new + line[col + len(old):]
    return "".join(lines)
