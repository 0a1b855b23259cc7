"""The sdist and the wheel a user installs from hold the whole package: every file under src/arborspec (the kernels'
C++ sources too, which the native backend compiles on first use) and the license. Only `.py` files were packed, so a
wheel's `arborspec kernels build` failed; the sdist carried 11 test files of the suite, which cannot run alone."""
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = ("pyproject.toml", "README.md", "LICENSE", "MANIFEST.in", "constraints.txt")


def _build(kind: str, source: Path, out: Path) -> Path:
    """setuptools' own build of `kind` ("sdist" / "wheel") from `source`, in a process of its own (it changes cwd)."""
    code = f"import setuptools.build_meta as b; print(b.build_{kind}({str(out)!r}))"
    done = subprocess.run([sys.executable, "-c", code], cwd=source, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return out / done.stdout.strip().splitlines()[-1]


@pytest.mark.slow
def test_the_sdist_and_the_wheel_built_from_it_hold_the_whole_package(tmp_path):
    checkout = tmp_path / "checkout"
    for name in SHIPPED:
        (checkout / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / name, checkout / name)
    shutil.copytree(ROOT / "src" / "arborspec", checkout / "src" / "arborspec",
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    (checkout / "tests").mkdir()
    (checkout / "tests" / "test_x.py").write_text("")  # setuptools packs tests/test*.py unless told not to
    package = sorted(p.relative_to(checkout / "src").as_posix()
                     for p in (checkout / "src" / "arborspec").rglob("*") if p.is_file())
    assert "arborspec/kernels/gguf_mm.cpp" in package and "arborspec/kernels/gguf_mm.h" in package

    sdist = _build("sdist", checkout, tmp_path / "dist")
    with tarfile.open(sdist) as tar:
        names = [n.split("/", 1)[1] for n in tar.getnames() if "/" in n]
        tar.extractall(tmp_path / "unpacked", filter="data")
    assert {f"src/{p}" for p in package} <= set(names)
    assert "LICENSE" in names and not any(n.startswith("tests/") for n in names)

    wheel = _build("wheel", tmp_path / "unpacked" / sdist.name.removesuffix(".tar.gz"), tmp_path / "wheels")
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        metadata = z.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
    assert set(package) <= set(names), sorted(set(package) - set(names))
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names)
    assert "License-Expression: Apache-2.0" in metadata and "Requires-Dist: torch==2.13.0" in metadata
