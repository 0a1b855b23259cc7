"""What this CPU is: for the keys of cached measurements and for the host line of benchmark reports.

Why more than /proc/cpuinfo's model name: cloud hosts give one name ("AMD EPYC") to Zen 3, Zen 4 and Zen 5 parts,
whose speeds differ ~2x and whose kernels differ (AVX2 only against AVX-512 VNNI). Keyed by that name alone, a cost
profile or a backend choice measured on one kind of host was read on another that shares the home directory (the
cache holds no other trace of the CPU). The family and model numbers and the flags line tell the parts apart: the
2-core hosts this project is measured on report family 25 (Zen 3 and Zen 4, by model number) or 26 (Zen 5: it has
AVX-VNNI and VP2INTERSECT besides AVX-512, which Zen 4 lacks; a host called "Zen 4" in notes up to 2026-11-26 by its
flags reported family 26 when first checked). An Intel host (2026-11-29: "Intel(R) Xeon(R) Processor", family 6 model
167 under KVM, with AVX-512 VNNI and AMX; 167 is a client part without AMX, so a hypervisor's model number need not
name the silicon) gets no core name: its line says family, model and code path, and the key holds its flags."""
from __future__ import annotations

import functools
import hashlib
import os
import platform
from dataclasses import dataclass, field, replace
from pathlib import Path


@dataclass(frozen=True)
class Cpu:
    name: str  # /proc/cpuinfo's model name
    vendor: str = ""
    family: int | None = None
    model: int | None = None
    flags: frozenset[str] = field(default_factory=frozenset)

    @property
    def isa(self) -> str:
        """The widest code path the native kernels have for this CPU (kernels/build.py compiles it)."""
        if {"avx512f", "avx512bw", "avx512vl", "avx512_vnni"} <= self.flags:
            return "AVX-512 VNNI"
        if {"avx2", "fma", "f16c"} <= self.flags:
            return "AVX2"
        return "no AVX2"

    @property
    def core(self) -> str:
        """AMD's core generation by family and model number ("" where unknown: other vendors, older parts)."""
        if self.vendor != "AuthenticAMD" or self.family is None or self.model is None:
            return ""
        if self.family == 26:
            return "Zen 5"
        if self.family == 25:  # Zen 4: Genoa 0x10-0x1f, Phoenix / Raphael 0x60-0x7f, Bergamo / Siena 0xa0-0xaf
            return "Zen 4" if self.model in range(0x10, 0x20) or self.model in range(0x60, 0x80) \
                or self.model in range(0xA0, 0xB0) else "Zen 3"
        if self.family == 23:
            return "Zen 2" if self.model >= 0x30 else "Zen"
        return ""

    def describe(self) -> str:
        """One line for a report: 'AMD EPYC (Zen 5, family 26 model 2; AVX-512 VNNI)'."""
        which = [self.core] if self.core else []
        if self.family is not None:
            which.append(f"family {self.family} model {self.model}")
        return f"{self.name} ({', '.join(which)}; {self.isa})" if which else f"{self.name} ({self.isa})"


def parse_cpuinfo(text: str) -> Cpu:
    """The first processor's entry of a /proc/cpuinfo text."""
    fields: dict[str, str] = {}
    for line in text.splitlines():
        if not line.strip():
            if fields:
                break  # the first processor only: the others repeat it
            continue
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())

    def number(key: str) -> int | None:
        try:
            return int(fields[key])
        except (KeyError, ValueError):
            return None

    return Cpu(name=fields.get("model name", ""), vendor=fields.get("vendor_id", ""), family=number("cpu family"),
               model=number("model"), flags=frozenset(fields.get("flags", "").split()))


@functools.cache
def this_cpu() -> Cpu:
    try:
        cpu = parse_cpuinfo(Path("/proc/cpuinfo").read_text())
    except OSError:
        cpu = Cpu(name="")
    return cpu if cpu.name else replace(cpu, name=platform.processor() or platform.machine() or "cpu")


def usable_cores() -> int:
    """The cores this process may run on (its affinity mask; fewer than os.cpu_count() under taskset or a pinned
    test worker)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def machine_id(cpu: Cpu | None = None) -> str:
    """What cached measurements are keyed by: the CPU (name, family, model and a hash of its flags), the logical cores
    and the architecture. Not the host name: containers rename hosts, not CPUs."""
    cpu = cpu or this_cpu()
    flags = hashlib.sha256(" ".join(sorted(cpu.flags)).encode()).hexdigest()[:12]
    return f"{cpu.name} family {cpu.family} model {cpu.model} flags {flags} x{os.cpu_count()} {platform.machine()}"
