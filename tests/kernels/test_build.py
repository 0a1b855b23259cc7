"""The kernels' build (kernels/build.py): a build a killed process left half done does not hang the next start; old
builds do not pile up in the cache."""
import fcntl
import os
import subprocess
import sys
import time

import pytest

from arborspec.core.downloads import file_lock
from arborspec.kernels.build import build_dir, library, prune_builds


def test_a_lock_file_left_by_a_killed_build_is_cleared():
    """torch's builder waits forever for its `lock` file to go; one left by a killed process (Ctrl-C in a first
    compile) hung every later start. A new process clears it and loads the kernels."""
    library()  # built (the setup script builds it; a first run here compiles it)
    directory = build_dir()
    with file_lock(directory / "build.lock"):  # no builder is inside torch's load while the stale file is made
        (directory / "lock").touch()
    code = "from arborspec.kernels.build import library; print(library().isa)"
    try:
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    finally:
        (directory / "lock").unlink(missing_ok=True)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == library().isa


def test_old_builds_are_removed_but_the_recent_the_current_and_the_busy_ones(tmp_path):
    """Builds 0..5, build i last used i hours ago; the current one is build 3, build 5 is locked by another user."""
    kernels = tmp_path / "kernels"
    names = [f"{i:016x}" for i in range(6)]
    for hours, name in enumerate(names):
        (kernels / name).mkdir(parents=True)
        (kernels / name / "arborspec_kernels.so").write_bytes(b"0")
        (kernels / name / "build.lock").touch()
        os.utime(kernels / name / "build.lock", (time.time() - 3600 * hours,) * 2)
    (kernels / "notes").mkdir()  # not a build
    with open(kernels / names[5] / "build.lock", "a") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        removed = prune_builds(kernels / names[3], keep=3)
    assert sorted(p.name for p in removed) == [names[2], names[4]]
    assert sorted(p.name for p in kernels.iterdir()) == sorted([names[0], names[1], names[3], names[5], "notes"])
    assert prune_builds(kernels / names[3], keep=3) == [kernels / names[5]]  # free now: the oldest goes


def test_a_damaged_library_is_built_again_not_loaded(tmp_path, monkeypatch):
    """ninja reloads a library newer than its sources: a truncated one killed the process in dlopen (SIGBUS), an
    empty one failed every start, and neither was built again. torch's builder is stood in for by one that builds
    only what is missing, as ninja does."""
    from pathlib import Path

    from torch.utils import cpp_extension

    from arborspec.kernels.build import compile_extension
    builds = []

    def ninja(name, sources, build_directory, **kwargs):
        library = Path(build_directory) / f"{name}.so"
        if not library.exists():
            library.write_bytes(b"\x7fELF" + b"x" * 4000)
            builds.append(name)
    monkeypatch.setattr(cpp_extension, "load", ninja)
    compile_extension("probe", tmp_path, [])
    compile_extension("probe", tmp_path, [])
    assert builds == ["probe"]  # a whole build is loaded as it is
    library = tmp_path / "probe.so"
    library.write_bytes(library.read_bytes()[:100])  # a disk that filled up, a copy cut short
    compile_extension("probe", tmp_path, [])
    assert builds == ["probe", "probe"] and library.stat().st_size == 4004


def test_two_checkouts_of_the_same_sources_compile_the_same_paths(tmp_path, monkeypatch):
    """ninja names each source by its path: a second checkout of the same sources sharing the cache's build folder
    rebuilt the library, and the first rebuilt it again. The build reads copies in the build folder, rewritten (with
    a new time, which ninja rebuilds on) only when a source's bytes change, its headers with it."""
    from pathlib import Path

    from torch.utils import cpp_extension

    from arborspec.kernels.build import compile_extension
    seen = []

    def ninja(name, sources, build_directory, **kwargs):
        seen.append(sources)
        (Path(build_directory) / f"{name}.so").write_bytes(b"\x7fELF")
    monkeypatch.setattr(cpp_extension, "load", ninja)
    checkouts = [tmp_path / "one", tmp_path / "two"]
    for folder in checkouts:
        folder.mkdir()
        (folder / "k.cpp").write_text('#include "k.h"\n')
        (folder / "k.h").write_text("int k();\n")
    compile_extension("probe", tmp_path / "build", [], [checkouts[0] / "k.cpp"])
    copied = tmp_path / "build" / "src" / "k.cpp"
    header = tmp_path / "build" / "src" / "k.h"
    stamps = copied.stat().st_mtime_ns, header.stat().st_mtime_ns
    compile_extension("probe", tmp_path / "build", [], [checkouts[1] / "k.cpp"])
    assert seen == [[str(copied)], [str(copied)]] and header.read_text() == "int k();\n"
    assert (copied.stat().st_mtime_ns, header.stat().st_mtime_ns) == stamps  # nothing for ninja to rebuild
    (checkouts[1] / "k.h").write_text("int k(int);\n")
    compile_extension("probe", tmp_path / "build", [], [checkouts[1] / "k.cpp"])
    assert header.read_text() == "int k(int);\n" and copied.stat().st_mtime_ns == stamps[0]


def test_two_torch_installations_build_in_two_folders(monkeypatch):
    """The build names torch's headers by path: two environments sharing one build folder rebuilt it in turn."""
    import torch

    from arborspec.kernels.build import cache_key
    here = cache_key.__wrapped__()
    assert cache_key.__wrapped__() == here
    monkeypatch.setattr(torch, "__file__", "/elsewhere/site-packages/torch/__init__.py")
    assert cache_key.__wrapped__() != here


def test_a_whole_build_in_a_read_only_cache_is_loaded_without_the_lock(tmp_path, monkeypatch):
    """A read-only cache (a shared image) held a whole build, and every start failed opening `build.lock` for
    writing: "could not build arborspec's kernels", and every model fell back to llama.cpp."""
    from pathlib import Path

    import torch
    from torch.utils import cpp_extension

    from arborspec.kernels import build

    def ninja(name, sources, build_directory, **kwargs):
        (Path(build_directory) / f"{name}.so").write_bytes(b"\x7fELF" + b"x" * 4000)

    monkeypatch.setattr(cpp_extension, "load", ninja)
    build.compile_extension("probe", tmp_path, [])
    loaded = []
    monkeypatch.setattr(torch.ops, "load_library", loaded.append)
    monkeypatch.setattr(build.os, "access", lambda path, mode: False)  # as on a read-only file system
    monkeypatch.setattr(cpp_extension, "load", lambda *a, **k: pytest.fail("built or locked"))
    build.compile_extension("probe", tmp_path, [])
    assert loaded == [str(tmp_path / "probe.so")]


def test_missing_sources_are_named_not_blamed_on_the_cache(tmp_path):
    """A wheel that carried only .py files failed with "could not build ... in <cache>: No such file or directory"."""
    from arborspec.kernels.build import KernelBuildError, compile_extension
    with pytest.raises(KernelBuildError, match=r"kernel sources are missing \(.*gone\.cpp\): reinstall"):
        compile_extension("probe", tmp_path / "build", [], [tmp_path / "gone.cpp"])
    assert not (tmp_path / "build").exists()


def test_the_ninja_package_is_found_off_path(tmp_path, monkeypatch):
    """torch's builder looks for `ninja` on PATH; a venv not activated has the pinned package's binary off PATH."""
    import shutil

    import ninja

    from arborspec.kernels.build import ninja_on_path
    monkeypatch.setenv("PATH", str(tmp_path))  # no ninja here
    assert shutil.which("ninja") is None
    ninja_on_path()
    assert shutil.which("ninja") == os.path.join(ninja.BIN_DIR, "ninja")
    ninja_on_path()
    assert os.environ["PATH"].count(ninja.BIN_DIR) == 1

