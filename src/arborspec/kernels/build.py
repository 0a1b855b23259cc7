"""Compile the kernels (`gguf_mm.cpp`, and the decoding step `forward.cpp`) for this CPU, once, and load them as
torch operators.

Why a torch C++ extension: the kernels split output rows across torch's own thread pool (`at::parallel_for`), so
they never fight torch's threads for the cores (two OpenMP pools spinning on 2 cores cost 10x), and they take and
return tensors without copies. It is compiled on first use (or by `arborspec kernels build`, which the set-up scripts
run) with `-march=native` into the arborspec cache, keyed by the source, the CPU's flags and torch's version and
place, so a machine never runs code built for another CPU. Nothing prebuilt is downloaded.
"""
from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import json
import os
import re
import shutil
import warnings
from pathlib import Path

import torch

from ..core.host import this_cpu

HERE = Path(__file__).parent
SOURCES = [HERE / "gguf_mm.cpp", HERE / "forward.cpp"]  # one library; forward.cpp calls gguf_mm.h
# the packed layouts' names, in the order gguf_mm.cpp's layouts() gives their numbers
LAYOUTS = ["q4k_rows8", "q4k_rows16", "q6k_rows16", "q5_0_rows16", "q8_0_rows16", "q4_0_rows16", "iq4_nl_rows16",
           "q4_0_rows8", "iq4_nl_rows8", "q5_0_rows8", "q8_0_rows8", "q6k_rows8"]
SIMDE_HEADER = "simde/x86/avx512.h"


class KernelBuildError(RuntimeError):
    """The kernels could not be compiled here (no C++ compiler, no ninja, ...): the message says what is missing."""


class NoEmulation(KernelBuildError):
    """This host cannot build the emulated AVX-512 kernels at all (not x86-64-v3, or no SIMDe): the tests skip the
    16-lane checks here. A compile error of a host that can is a KernelBuildError, and fails them."""


@functools.cache
def library() -> "Kernels":
    """The kernels, compiled for this CPU on first use (about a minute) and loaded from the cache afterwards."""
    try:
        compile_extension("arborspec_kernels", build_dir(), ["-O3", "-march=native", "-fopenmp"])
    except KernelBuildError:
        raise
    except OSError as exc:  # the cache itself (a file in its place, no permission): no compiler is missing
        raise KernelBuildError(f"could not build arborspec's kernels in {build_dir()}: {exc.strerror or exc}") from exc
    except Exception as exc:  # a missing compiler or ninja, a compile error: say what is missing, in one line
        raise KernelBuildError(f"could not compile arborspec's kernels ({explain(exc)}); they need a C++ compiler "
                               "(g++ or clang++) and ninja (pip install ninja)") from exc
    with contextlib.suppress(OSError):  # tidying the cache never stops a load
        prune_builds(build_dir())
    kernels = Kernels("arborspec_kernels")
    if kernels.isa == "scalar":
        warnings.warn("this CPU has no AVX2: arborspec's kernels run their portable scalar code (several times "
                      "slower); the llama.cpp backend is the faster choice here", stacklevel=2)
    return kernels


KEEP_BUILDS = 4  # kernel builds kept in the cache, the most recently used (~2 MB each, a few more with the tests'
# and benchmarks' builds inside): every change of the sources, the CPU's flags or torch's version makes a new one,
# and 98 builds had gathered to 240 MB in one development cache


def prune_builds(current: Path, keep: int = KEEP_BUILDS) -> list[Path]:
    """Remove the kernel builds beside `current` but the `keep` - 1 most recently used (by their build.lock, which
    every load opens and so stamps); never `current`, nor a build whose lock another process holds (it is compiling
    or loading there). Returns the removed folders. Two arborspec versions sharing one cache keep their builds as
    long as fewer than `keep` are in use."""
    others = [d for d in current.parent.iterdir()
              if d.is_dir() and d != current and re.fullmatch(r"[0-9a-f]{16}", d.name)]
    others.sort(key=lambda d: (d / "build.lock").stat().st_mtime if (d / "build.lock").exists() else 0.0,
                reverse=True)
    removed = []
    for old in others[max(keep - 1, 0):]:
        try:
            with open(old / "build.lock", "a") as f:  # "a": opening does not stamp it
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                shutil.rmtree(old)
        except OSError:  # held by another process (BlockingIOError), or gone already
            continue
        removed.append(old)
    return removed


def compile_extension(name: str, directory: Path, cflags: list[str], sources: list[Path] = SOURCES) -> None:
    """Build (or find built) and load `sources` (the kernels' own, or another commit's copy of them:
    benchmarks/kernels_ab.py) as the operator library `name` in `directory`.

    Why the sources are copied into the build first: ninja's build file names each source by its path, so a second
    checkout (or a worktree, or an installed copy) of the very same sources, which shares the cache's build folder,
    rebuilt the library (47-94 s here) and the first checkout rebuilt it again on its next start. The copies are
    written only when their bytes differ, so an unchanged source keeps its time and ninja has nothing to do.

    Why the lock of our own: torch's builder marks a build in progress with a file `lock` in the directory and waits,
    polling forever, for it to go; a process killed in there (Ctrl-C in a first run's compile, a timeout) leaves the
    file behind, and every later start hung silently (it happened twice in one session here). Every arborspec
    process builds under an flock, which the kernel releases when its holder dies: holding it, a `lock` file can
    only be a dead process's, and is removed."""
    from torch.utils import cpp_extension

    from ..core.children import children_stop_with_us
    from ..core.disk_cache import atomic_write
    from ..core.downloads import file_lock
    missing = [str(s) for s in sources if not Path(s).is_file()]
    if missing:  # it read as a cache problem: "could not build ... in <cache>: No such file or directory"
        raise KernelBuildError(f"arborspec's kernel sources are missing ({', '.join(missing)}): reinstall arborspec "
                               "from a package that carries them (its kernels/*.cpp and *.h)")
    directory.mkdir(parents=True, exist_ok=True)
    ninja_on_path()
    library, marker = directory / f"{name}.so", directory / f"{name}.built.json"
    if not os.access(directory, os.W_OK) and library.exists() and _read(marker) == _fingerprint(library):
        torch.ops.load_library(str(library))  # a read-only cache with a whole build (the lock file cannot be opened)
        return
    with file_lock(directory / "build.lock"):
        (directory / "lock").unlink(missing_ok=True)
        if library.exists() and _read(marker) != _fingerprint(library):
            library.unlink()  # damaged, or left by a build that did not finish: ninja builds it again
        copies = copy_sources(sources, directory / "src")
        with children_stop_with_us():  # `timeout` or `kill PID` left ninja and the compilers running, orphaned
            cpp_extension.load(name=name, sources=[str(s) for s in copies], build_directory=str(directory),
                               extra_cflags=cflags, extra_ldflags=["-fopenmp"], is_python_module=False, verbose=False)
        built = _fingerprint(library)  # hashed once: the library ninja left, rebuilt or not
        if _read(marker) != built:
            atomic_write(marker, json.dumps(built))


def copy_sources(sources: list[Path], folder: Path) -> list[Path]:
    """`sources` and the headers beside them (what they include as "gguf_mm.h") in `folder`, each written only where
    its bytes differ; returns the copies of `sources`."""
    folder.mkdir(exist_ok=True)
    headers = {h for s in sources for h in Path(s).parent.glob("*.h")}
    for path in [Path(s) for s in sources] + sorted(headers):
        copy, data = folder / path.name, path.read_bytes()
        if not copy.is_file() or copy.read_bytes() != data:
            copy.write_bytes(data)
    return [folder / Path(s).name for s in sources]


def ninja_on_path() -> None:
    """torch's builder runs `ninja` from PATH alone; the pinned `ninja` package puts it in the environment's bin
    folder, which is not on PATH when the environment is not activated (`.venv/bin/arborspec kernels build`, as
    scripts/setup.sh runs it): on a host without a system ninja that failed with "pip install ninja", which was."""
    if shutil.which("ninja"):
        return
    try:
        import ninja
    except ImportError:  # the build then says that ninja is missing
        return
    os.environ["PATH"] = os.environ.get("PATH", "") + os.pathsep + ninja.BIN_DIR


def _fingerprint(library: Path) -> dict:
    """What a whole build's library is, checked before it is loaded: ninja reloads any library newer than its
    sources, and a truncated one killed the process in dlopen with SIGBUS, an empty one failed every start (with a
    hint about compilers), and neither was ever built again."""
    return {"size": library.stat().st_size, "sha256": hashlib.sha256(library.read_bytes()).hexdigest()}


def _read(marker: Path) -> dict | None:
    try:
        return json.loads(marker.read_text())
    except (OSError, ValueError):
        return None


@functools.cache
def emulated_library() -> "Kernels":
    """The same source's AVX-512 VNNI code compiled for any x86-64 CPU with AVX2 (`-march=x86-64-v3`), the AVX-512
    intrinsics implemented in portable code by SIMDe (Debian: libsimde-dev, header-only): so the tests prove the VNNI
    kernels exact, and the step's 16-lane attention equal to its 8-lane code (forward.cpp), on hosts without them.
    Slow (never time it); loaded beside the native build under its own operator namespace
    (torch.ops.arborspec_kernels_emulated, torch.classes.arborspec_kernels_emulated) and C++ namespace, since one
    process holds both."""
    import platform
    if platform.machine() not in ("x86_64", "AMD64"):
        raise NoEmulation(f"the emulated AVX-512 build needs an x86-64 CPU, this one is {platform.machine()}")
    missing = {"avx2", "fma", "f16c", "bmi1", "bmi2", "movbe"} - this_cpu().flags
    if missing:  # the emulated code still runs AVX2 instructions natively
        raise NoEmulation("the emulated AVX-512 build needs an x86-64-v3 CPU (AVX2, FMA, F16C, BMI); this one "
                          f"lacks {', '.join(sorted(missing))}")
    if not simde_found():
        raise NoEmulation(f"the emulated AVX-512 build needs SIMDe's headers ({SIMDE_HEADER}; Debian: "
                          "apt-get install libsimde-dev)")
    try:
        compile_extension("arborspec_kernels_emulated", build_dir() / "emulated",
                          ["-O2", "-march=x86-64-v3", "-fopenmp", "-DARB_SIMDE", "-DARB_OPS=arborspec_kernels_emulated",
                           "-Darborspec=arborspec_emulated"])
    except Exception as exc:
        raise KernelBuildError(f"could not compile the emulated AVX-512 kernels ({explain(exc)})") from exc
    return Kernels("arborspec_kernels_emulated")


def simde_found() -> bool:
    """Whether the compiler's include path has SIMDe (asked from the compiler itself, not guessed)."""
    import shutil
    import subprocess
    compiler = shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")
    if compiler is None:
        return False
    probe = subprocess.run([compiler, "-x", "c++", "-E", "-", "-o", "/dev/null"], input=f"#include <{SIMDE_HEADER}>\n",
                           capture_output=True, text=True)
    return probe.returncode == 0


class Kernels:
    """The compiled operators (torch.ops.<namespace>): the native build's, or the emulated one's (tests)."""

    def __init__(self, namespace: str):
        self.ops = getattr(torch.ops, namespace)
        self.isa = self.ops.isa()  # "avx512vnni", "avx2" or "scalar": the best code this build runs
        # the packed layouts' numbers (gguf_mm.h), by name
        self.layouts = dict(zip(LAYOUTS, self.ops.layouts().tolist()))

    def activations(self, x: torch.Tensor, qtype) -> torch.Tensor:
        """x (m, k) as the kernels quantize it (dequantized, float32): for tests against the reference."""
        return self.ops.dequantized_activations(x.contiguous(), int(qtype))


def explain(exc: Exception) -> str:
    text = str(exc).strip()
    for line in text.splitlines():
        if "error" in line.lower() or "not found" in line.lower():
            return line.strip()[:200]
    return (text.splitlines()[0] if text else type(exc).__name__)[:200]


@functools.cache
def cache_key() -> str:
    """Hash of the kernels' sources, this CPU's flags, torch's version and where torch is installed (read once per
    process). Why the place: the build names torch's headers by their path, so two environments (a checkout's .venv
    and a clone's) sharing one build folder rebuilt it in turn on every switch (24-50 s each, seen here)."""
    flags = " ".join(sorted(this_cpu().flags))
    sources = sorted(HERE.glob("*.cpp")) + sorted(HERE.glob("*.h")) + [Path(__file__)]
    place = str(Path(torch.__file__).resolve().parent)
    text = b"".join(p.read_bytes() for p in sources) + flags.encode() + torch.__version__.encode() + place.encode()
    return hashlib.sha256(text).hexdigest()[:16]


def build_dir() -> Path:
    from ..core.disk_cache import cache_dir
    return cache_dir() / "kernels" / cache_key()
