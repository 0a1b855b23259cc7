"""The kernels (kernels/gguf_mm.cpp) against the scalar reference (kernels/reference.py: weights dequantized by the
`gguf` package, activations quantized the same way), for every block type, every layout, both code paths, and M
across a tile; for the native build and for the emulated AVX-512 VNNI build (SIMDe), so the VNNI kernels are proven
exact on hosts without VNNI too."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as QT
from hypothesis import given, settings
from hypothesis import strategies as st

from arborspec.kernels import QuantMatrix, supported
from arborspec.kernels.build import NoEmulation, emulated_library, library
from arborspec.kernels.matrix import ROWS8_TYPES
from arborspec.kernels.reference import ACTIVATION_BLOCK, quantize_activations

from .blocks import KINDS, random_blocks

PATHS = [False, True]  # the build's best code (VNNI, AVX2, or the scalar code where the CPU has neither), the scalar


def emulated():
    """The emulated AVX-512 VNNI build, or a skip saying why there is none here."""
    try:
        return emulated_library()
    except NoEmulation as err:
        pytest.skip(str(err))


# (kernels, the layouts' isa): the native build with its best layouts, the native build with the VNNI layouts (run by
# its scalar code where it has no VNNI), the native build with the AVX2 layouts (x8: run by its AVX2 code, which every
# build on an AVX2 CPU has, VNNI ones included), and the emulated VNNI build
BUILDS = {"native": (library, None), "native-x16": (library, "avx512vnni"), "native-x8": (library, "avx2"),
          "emulated": (emulated, None)}


def assert_close(y: torch.Tensor, ref: torch.Tensor, matrix: QuantMatrix, x: torch.Tensor) -> None:
    """Equal up to float rounding of the block scales (the integer dot products are exact in both), which is
    relative to the sum of the terms' magnitudes, |x| · |W|ᵀ, not to the result: sums may cancel."""
    bound = quantize_activations(x, matrix.qtype).abs().double() @ matrix.dequantize().abs().double().T
    err = (y.double() - ref.double()).abs()
    assert torch.all(err <= 1e-5 * bound + 1e-30), (err / bound).max().item()


def assert_same_activations(got: torch.Tensor, want: torch.Tensor, x: torch.Tensor, qtype) -> None:
    """The kernel's 8-bit activations are the reference's, except where x / scale falls within float rounding of a
    half: the two compute it in different float orders, so such a tie may round the other way, one step off."""
    block = ACTIVATION_BLOCK[qtype]
    m, k = x.shape
    step = x.reshape(m, k // block, block).abs().amax(dim=-1, keepdim=True) / 127  # one 8-bit step of each block
    step = step.expand(m, k // block, block).reshape(m, k)
    off = ~torch.isclose(got, want, rtol=1e-6, atol=1e-7)
    assert torch.all((got - want).abs()[off] <= 1.01 * step[off])
    assert off.sum() <= max(1, got.numel() // 1000), int(off.sum())


ROWS = st.one_of(st.integers(1, 40), st.sampled_from([16, 32, 48]))  # multiples of 16 take the x16 layouts


def check_against_reference(kernels, isa, qtype, n, blocks, m, seed, magnitude):
    rng = np.random.default_rng(seed)
    k = blocks * ACTIVATION_BLOCK[qtype]
    matrix = QuantMatrix(random_blocks(qtype, n, k, rng, magnitude), qtype, n, k, kernels=kernels, isa=isa)
    x = torch.from_numpy(rng.standard_normal((m, k)).astype(np.float32)) * float(rng.choice([1e-3, 1.0, 30.0]))
    acts = kernels.activations(x, qtype)  # what both code paths multiply by
    assert_same_activations(acts, quantize_activations(x, qtype), x, qtype)
    # the reference on the kernel's own activations (reference_matmul's, but for a tie rounded the other way)
    ref = acts.double() @ matrix.dequantize().double().T
    for scalar in PATHS:
        y = matrix(x, scalar=scalar)
        assert_close(y, ref, matrix, x)
        # row-independent: a row's result does not depend on the rows sharing the call (bit for bit)
        i = int(rng.integers(0, m))
        assert torch.equal(y[i:i + 1], matrix(x[i:i + 1], scalar=scalar))


@settings(max_examples=60, deadline=None)
@given(qtype=st.sampled_from(KINDS), n=ROWS, blocks=st.integers(1, 3), m=st.integers(1, 33),
       seed=st.integers(0, 2**32 - 1), magnitude=st.sampled_from([1e-3, 1.0, 40.0]))
def test_kernels_equal_the_reference(qtype, n, blocks, m, seed, magnitude):
    check_against_reference(library(), None, qtype, n, blocks, m, seed, magnitude)


@settings(max_examples=20, deadline=None)
@given(qtype=st.sampled_from(KINDS), groups=st.integers(1, 2), blocks=st.integers(1, 2), m=st.integers(1, 33),
       seed=st.integers(0, 2**32 - 1), magnitude=st.sampled_from([1e-3, 1.0, 40.0]))
def test_vnni_layouts_equal_the_reference(qtype, groups, blocks, m, seed, magnitude):
    """The x16 layouts on the native build's code for them (VNNI, or their scalar code on a CPU without it)."""
    check_against_reference(library(), "avx512vnni", qtype, 16 * groups, blocks, m, seed, magnitude)


@settings(max_examples=20, deadline=None)
@given(qtype=st.sampled_from(ROWS8_TYPES), groups=st.integers(1, 3), blocks=st.integers(1, 3), m=st.integers(1, 33),
       seed=st.integers(0, 2**32 - 1), magnitude=st.sampled_from([1e-3, 1.0, 40.0]))
def test_avx2_layouts_equal_the_reference(qtype, groups, blocks, m, seed, magnitude):
    """The 8-row layouts (q4_K x8, q6_K x8, the 32-blocks' x8) on the native build's code for them (AVX2, or their
    scalar code on a CPU without it), M across the 16-row tile."""
    check_against_reference(library(), "avx2", qtype, 8 * groups, blocks, m, seed, magnitude)


@settings(max_examples=16, deadline=None)
@given(qtype=st.sampled_from(KINDS), groups=st.integers(1, 2), blocks=st.integers(1, 2), m=st.integers(1, 33),
       seed=st.integers(0, 2**32 - 1), magnitude=st.sampled_from([1e-3, 1.0, 40.0]))
def test_emulated_vnni_kernels_equal_the_reference(qtype, groups, blocks, m, seed, magnitude):
    """The AVX-512 VNNI code itself, on any x86-64 host with AVX2 (SIMDe); kept small: emulation is slow."""
    check_against_reference(emulated(), None, qtype, 16 * groups, blocks, m, seed, magnitude)


@pytest.mark.parametrize("qtype", KINDS)
def test_activation_quantization_equals_the_reference(qtype):
    rng = np.random.default_rng(1)
    k = 2 * ACTIVATION_BLOCK[qtype]
    x = torch.from_numpy(rng.standard_normal((5, k)).astype(np.float32))
    x[1, : ACTIVATION_BLOCK[qtype]] = 0.0  # an all-zero block: scale 0, no division by zero
    x[2, 7] = -50.0  # the largest magnitude negative: the K-quant scale keeps its sign
    got = library().activations(x, qtype)
    want = quantize_activations(x, qtype)
    assert torch.allclose(got, want, rtol=1e-6, atol=1e-7)
    assert torch.all(got[1, : ACTIVATION_BLOCK[qtype]] == 0)


@pytest.mark.parametrize("build", BUILDS)
@pytest.mark.parametrize("qtype", KINDS)
@pytest.mark.parametrize("n", [8, 16, 13, 32])
def test_packed_layouts_keep_every_bit(build, qtype, n):
    """Matrices are repacked at load (by 8 rows for AVX2, by 16 for VNNI: every type);
    unpacking gives the file's bytes back, and the packed matrix computes what the file's layout computes."""
    make, isa = BUILDS[build]
    kernels = make()
    isa = isa or kernels.isa
    k = 2 * ACTIVATION_BLOCK[qtype]
    raw = random_blocks(qtype, n, k, np.random.default_rng(n))
    matrix = QuantMatrix(raw, qtype, n, k, kernels=kernels, isa=isa)
    x16 = isa == "avx512vnni" and n % 16 == 0
    x8 = n % 8 == 0 and qtype in ROWS8_TYPES and isa != "scalar"
    assert matrix.packed == (x16 or x8)
    if x8 and not x16 and qtype != QT.Q4_K:
        assert matrix.data.shape == (n // 8, 8 * matrix.row_bytes)  # the file's bytes, rearranged
    assert torch.equal(matrix.blocks(), torch.from_numpy(raw))
    plain = QuantMatrix(raw, qtype, n, k, pack=False, kernels=kernels)
    x = torch.randn(3, k)
    assert_close(matrix(x), plain(x), plain, x)
    index = torch.tensor([[n - 1, 0], [n // 2, n - 1]])
    assert torch.equal(matrix.rows(index), plain.rows(index))


@pytest.mark.parametrize("build", BUILDS)
def test_concat_of_packed_matrices_computes_each_part(build):
    """q/k/v and gate/up are merged into one matrix: its product is the parts' side by side, bit for bit."""
    make, isa = BUILDS[build]
    kernels = make()
    rng = np.random.default_rng(5)
    parts = [QuantMatrix(random_blocks(QT.Q6_K, n, 256, rng), QT.Q6_K, n, 256, kernels=kernels, isa=isa)
             for n in (32, 16, 16)]
    x = torch.randn(5, 256)
    alone = torch.cat([p(x) for p in parts], dim=1)
    whole = QuantMatrix.concat(parts)
    assert whole.layout == parts[0].layout and whole.n == 64
    assert torch.equal(whole(x), alone)
    assert torch.equal(torch.cat([p(x) for p in parts], dim=1), alone)  # the parts, now views, still work


def test_results_do_not_depend_on_the_thread_count():
    """Columns are split across threads and each is summed in a fixed order: bit-identical results."""
    rng = np.random.default_rng(2)
    mats = [QuantMatrix(random_blocks(t, 64, 512, rng), t, 64, 512) for t in KINDS]
    x = torch.randn(6, 512)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = [m(x) for m in mats]
        torch.set_num_threads(2)
        two = [m(x) for m in mats]
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(a, b) for a, b in zip(one, two))


@pytest.mark.parametrize("qtype", KINDS)
def test_embedding_rows_equal_the_dequantized_matrix(qtype):
    """The C++ row lookup (what the native step's embedding runs) against gguf's dequantizer, every type."""
    k = ACTIVATION_BLOCK[qtype] * 2
    raw = random_blocks(qtype, 12, k, np.random.default_rng(3))
    matrix = QuantMatrix(raw, qtype, 12, k)
    index = torch.tensor([[3, 0], [11, 3]])
    assert torch.equal(matrix.rows(index), matrix.dequantize()[index])


def test_bad_input_gets_a_clear_error():
    rng = np.random.default_rng(4)
    assert not supported(QT.F16) and not supported(QT.Q5_1)
    with pytest.raises(ValueError, match="no kernel for GGUF type Q5_1"):
        QuantMatrix(np.zeros((2, 24), np.uint8), QT.Q5_1, 2, 32)
    with pytest.raises(ValueError, match="not a multiple of Q4_K's block of 256"):
        QuantMatrix(np.zeros((2, 144), np.uint8), QT.Q4_K, 2, 128)
    matrix = QuantMatrix(random_blocks(QT.Q8_0, 4, 64, rng), QT.Q8_0, 4, 64)
    with pytest.raises(ValueError, match=r"expected activations \(m, 64\)"):
        matrix(torch.zeros(2, 32))


@pytest.mark.parametrize("build", BUILDS)
@pytest.mark.parametrize("qtype", KINDS)
def test_every_path_computes_the_exact_integer_products(build, qtype):
    """With unit block scales and integer activations whose 8-bit scale is exactly 1, every product is an integer
    small enough for float32: each code path (VNNI, AVX2, scalar; file and packed layouts) must give it exactly, bit
    for bit, so a path that drops or double-counts one weight, offset or min cannot hide in float rounding."""
    make, isa = BUILDS[build]
    kernels = make()
    rng = np.random.default_rng(int(qtype))
    n, k = 32, 2 * ACTIVATION_BLOCK[qtype]
    raw = random_blocks(qtype, n, k, rng).reshape(n, -1, GGML_QUANT_SIZES[qtype][1])
    one = np.array([1.0], np.float16).view(np.uint8)
    if qtype == QT.Q6_K:
        raw[:, :, 208:210] = one
    else:
        raw[:, :, 0:2] = one
        if qtype == QT.Q4_K:
            raw[:, :, 2:4] = one  # dmin
    raw = raw.reshape(n, -1)
    x = torch.from_numpy(rng.integers(-3, 4, size=(5, k)).astype(np.float32))
    block = ACTIVATION_BLOCK[qtype]
    x[:, ::block] = 127.0  # each block's largest value: its 8-bit scale is 1 (K-quants: -1, the signs flipped)
    matrices = [QuantMatrix(raw, qtype, n, k, kernels=kernels, isa=isa),
                QuantMatrix(raw, qtype, n, k, pack=False, kernels=kernels)]
    w = matrices[1].dequantize().double()
    assert torch.equal(w, w.round())  # integer weights
    exact = x.double() @ w.T
    assert exact.abs().max() < 2**24
    for matrix in matrices:
        for scalar in PATHS:
            assert torch.equal(matrix(x, scalar=scalar).double(), exact), (matrix.layout, scalar)


@pytest.mark.parametrize("build", BUILDS)
@pytest.mark.parametrize("qtype", KINDS)
def test_a_nan_activation_makes_its_rows_outputs_nan_on_every_path(build, qtype):
    """As the reference's (torch's amax keeps a NaN): the activation quantizer's max dropped it, so a NaN reaching a
    matrix came out finite, and a GGUF with a NaN scale gave finite garbage logits on native (an error elsewhere)."""
    make, isa = BUILDS[build]
    kernels = make()
    rng = np.random.default_rng(5)
    n, k, block = 16, 2 * ACTIVATION_BLOCK[qtype], ACTIVATION_BLOCK[qtype]
    matrix = QuantMatrix(random_blocks(qtype, n, k, rng), qtype, n, k, kernels=kernels, isa=isa)
    x = torch.from_numpy(rng.standard_normal((3, k)).astype(np.float32))
    x[1, block + 5] = float("nan")  # in the second block of row 1
    acts = kernels.activations(x, qtype)
    assert torch.equal(acts.isnan(), quantize_activations(x, qtype).isnan())  # that block, as the reference's
    assert acts[1, block:].isnan().all() and not acts[[0, 2]].isnan().any() and not acts[1, :block].isnan().any()
    for scalar in PATHS:
        y = matrix(x, scalar=scalar)
        assert y[1].isnan().all() and torch.isfinite(y[[0, 2]]).all(), scalar
