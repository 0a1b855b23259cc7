"""The scripts under benchmarks/: a bad value is one line and exit status 2, before anything is measured or loaded
(they ended in tracebacks: a KeyError for an unknown config, "budget ... got -1" for --sizes 0)."""
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]


@pytest.mark.parametrize("script, args, message", [
    ("block_sparsity.py", ["--sizes", "0"], "--sizes must list positive integers, got '0'"),
    ("block_sparsity.py", ["--prefixes", "x"], "--prefixes must be a comma-separated list of integers >= 0"),
    ("stree_packed_vs_unrolled.py", ["--configs", "garbage"], "unknown config 'garbage'; choose from 130m, 370m"),
    ("policies.py", ["--methods", "foo", "--target", "/nonexistent"], "unknown method 'foo'"),
    ("verifiers_same_trees.py", ["--prompts", "-1"], "--prompts must be at least 1, got -1"),  # ran none, exit 0
    ("draws.py", ["--vocabs", "8,x"], "--vocabs must be a comma-separated list of integers, got '8,x'"),
    ("draws.py", ["--repeats", "0"], "--repeats must be at least 1, got 0"),
    ("top_p.py", ["--top-ps", "0.9,x"], "--top-ps must be comma-separated numbers, got '0.9,x'"),
    ("top_p.py", ["--top-ps", "1.5", "--model", "/nonexistent"], "top_p must be in (0, 1], got 1.5"),
    ("top_p.py", ["--rows", "0"], "--rows and --repeats must be at least 1, got 0 and 3"),
])
def test_a_bad_value_is_one_line_and_exit_2(script, args, message):
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / script), *args], capture_output=True, text=True,
                          timeout=300, cwd=ROOT)
    assert proc.returncode == 2 and message in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
