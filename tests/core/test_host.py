"""The CPU's identity: hosts that share a model name but not a core generation or ISA get different cache keys."""
from arborspec.core.host import Cpu, machine_id, parse_cpuinfo, this_cpu

ZEN5 = """processor\t: 0
vendor_id\t: AuthenticAMD
cpu family\t: 26
model\t\t: 2
model name\t: AMD EPYC
flags\t\t: fpu sse2 avx2 fma f16c avx512f avx512bw avx512vl avx512_vnni avx_vnni avx512_vp2intersect

processor\t: 1
vendor_id\t: AuthenticAMD
cpu family\t: 26
model\t\t: 2
model name\t: AMD EPYC
flags\t\t: fpu sse2 avx2 fma f16c avx512f avx512bw avx512vl avx512_vnni avx_vnni avx512_vp2intersect
"""
ZEN3 = ZEN5.replace("cpu family\t: 26", "cpu family\t: 25").replace("model\t\t: 2", "model\t\t: 1").replace(
    " avx512f avx512bw avx512vl avx512_vnni avx_vnni avx512_vp2intersect", "")


def test_the_same_model_name_on_two_generations_reads_as_two_machines():
    zen5, zen3 = parse_cpuinfo(ZEN5), parse_cpuinfo(ZEN3)
    assert zen5.name == zen3.name == "AMD EPYC"
    assert (zen5.family, zen5.model, zen3.family, zen3.model) == (26, 2, 25, 1)
    assert machine_id(zen5) != machine_id(zen3)
    # only the flags differ: still two machines (a kernel built for one would not run on the other)
    assert machine_id(zen5) != machine_id(Cpu(zen5.name, zen5.vendor, zen5.family, zen5.model, zen3.flags))


def test_the_report_line_names_the_core_and_the_kernels_code_path():
    assert parse_cpuinfo(ZEN5).describe() == "AMD EPYC (Zen 5, family 26 model 2; AVX-512 VNNI)"
    assert parse_cpuinfo(ZEN3).describe() == "AMD EPYC (Zen 3, family 25 model 1; AVX2)"
    genoa = parse_cpuinfo(ZEN5.replace("cpu family\t: 26", "cpu family\t: 25").replace("model\t\t: 2", "model\t\t: 17"))
    assert genoa.core == "Zen 4"
    intel = parse_cpuinfo(ZEN3.replace("AuthenticAMD", "GenuineIntel").replace("AMD EPYC", "Xeon"))
    assert intel.describe() == "Xeon (family 25 model 1; AVX2)"
    assert Cpu("old", flags=frozenset({"sse2"})).describe() == "old (no AVX2)"


def test_this_cpu_is_read_from_the_machine():
    cpu = this_cpu()
    assert cpu.name and cpu.describe().startswith(cpu.name)
    assert machine_id() == machine_id(cpu)
