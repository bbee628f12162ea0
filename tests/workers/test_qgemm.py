"""The int8 matmul on quantized blocks (csrc/qgemm.c) against gguf's dequantization: every
weight type, 1-17 activation rows (both activation layouts), the portable path against
this host's SIMD one, and the SIMD path this host does not take (AVX2 on a VNNI host, the
VNNI code with dpbusd emulated on an AVX2 one); the AVX-512 / AVX-VNNI builds compiled."""

from __future__ import annotations

import ctypes
import re

import numpy as np
import pytest
import torch
from c_kernels import require_kernel
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from kvserve.workers.loading.quant_format import QTYPES, QuantizedWeight
from kvserve.workers.model.cpu_kernels import compile_errors, load_decode_step
from kvserve.workers.model.quant_linear import qlinear_int8, scratch

ROWS = list(range(1, 18))
PORTABLE = ("-mno-avx", "-mno-avx2", "-mno-fma", "-mno-f16c", "-mno-avx512f")


@pytest.fixture(scope="module")
def lib():
    return require_kernel("decode_step", load_decode_step())


def random_blocks(qtype: str, n: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """Raw ggml rows [n, k / block * bytes]: random bytes, with sane fp16 scales."""
    _, block, size = QTYPES[qtype]
    nb = n * k // block
    raw = rng.integers(0, 256, (nb, size), dtype=np.uint8)

    def half(scale: float) -> np.ndarray:
        return (rng.standard_normal(nb) * scale).astype(np.float16).view(np.uint8).reshape(nb, 2)

    if qtype in ("Q4_0", "Q5_0", "Q8_0"):
        raw[:, 0:2] = half(0.05)
    elif qtype in ("Q4_1", "Q5_1"):
        raw[:, 0:2], raw[:, 2:4] = half(0.05), half(0.2)
    elif qtype in ("Q4_K", "Q5_K"):
        raw[:, 0:2], raw[:, 2:4] = half(0.01), half(0.01)
    else:  # Q6_K: d last
        raw[:, 208:210] = half(0.01)
    return raw.reshape(n, -1)


def q8_rows(x: np.ndarray) -> np.ndarray:
    """The activations as the kernel sees them: 8 bits per 32 values, scale amax / 127."""
    xb = x.reshape(x.shape[0], -1, 32).astype(np.float32)
    amax = np.abs(xb).max(-1, keepdims=True)
    inv = np.where(amax > 0, np.float32(127) / np.where(amax > 0, amax, 1), 0).astype(np.float32)
    return (np.rint(xb * inv) * (amax / np.float32(127))).reshape(x.shape)


def _ref(lib, qw: QuantizedWeight, x: torch.Tensor, interleaved: bool) -> torch.Tensor:
    n, k = qw.shape
    m = x.shape[0]
    out = torch.empty(m, n)
    buf = scratch(lib.qgemm_scratch_bytes(m, k))
    lib.qgemm_q8_ref.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
                                 ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p,
                                 ctypes.c_void_p, ctypes.c_int]
    rc = lib.qgemm_q8_ref(QTYPES[qw.qtype][0], qw.data.data_ptr(), n, k, qw.data.shape[1],
                          x.contiguous().data_ptr(), m, out.data_ptr(), buf.data_ptr(), int(interleaved))
    assert rc == 0
    return out


def _case(qtype: str, m: int, seed: int = 0, k: int | None = None) -> tuple[QuantizedWeight, torch.Tensor, np.ndarray]:
    rng = np.random.default_rng([*qtype.encode(), m, seed, k or 0])
    n = 37  # odd: the threads' shares differ
    k = k or (512 if QTYPES[qtype][1] == 256 else 160)  # two super-blocks, or 5 blocks (not 8s)
    raw = random_blocks(qtype, n, k, rng)
    x = torch.from_numpy(rng.standard_normal((m, k)).astype(np.float32))
    x[:, 7] *= 40  # an outlier channel, as real activations have
    return QuantizedWeight(qtype, torch.from_numpy(raw), (n, k)), x, raw


@pytest.mark.parametrize("qtype", list(QTYPES))
@pytest.mark.parametrize("m", ROWS)
def test_int8_kernel_matches_gguf_dequantize(lib, qtype: str, m: int) -> None:
    """Against float64 products of gguf's dequantized weights and the 8-bit activations:
    only the float32 sums differ; and bit for bit the scalar reference's arithmetic."""
    qw, x, raw = _case(qtype, m)
    w = dequantize(raw, GGMLQuantizationType[qtype]).astype(np.float64)
    xq = q8_rows(x.numpy()).astype(np.float64)
    got = qlinear_int8(x, qw, lib)
    err = np.abs(got.numpy() - xq @ w.T)
    assert (err <= 2e-6 * (np.abs(xq) @ np.abs(w).T) + 1e-6).all()
    assert torch.equal(got, _ref(lib, qw, x, interleaved=m >= 7))
    # and as close to the float activations' product as 8-bit rounding allows: each value
    # moves by at most half a step, amax / 254 of its block
    exact = x.double().numpy() @ w.T
    xb = x.numpy().reshape(m, -1, 32)
    step = np.repeat(np.abs(xb).max(-1) / 254, 32, axis=1).astype(np.float64)
    assert (np.abs(got.numpy() - exact) <= 1.0001 * step @ np.abs(w).T + 1e-5).all()


@pytest.mark.parametrize("qtype", list(QTYPES))
def test_a_row_does_not_depend_on_its_batch(lib, qtype: str) -> None:
    """Row 0 gives the same bits alone, among 4 rows (row-major layout) and among 9 or 17
    (interleaved): a request's tokens do not depend on what it is batched with."""
    qw, x, _ = _case(qtype, 17, seed=1)
    alone = qlinear_int8(x[:1], qw, lib)
    for m in (4, 9, 17):
        assert torch.equal(qlinear_int8(x[:m], qw, lib)[:1], alone), m
    # a strided view (a slice of a fused output) reads the same rows
    wide = torch.cat([x, torch.randn(17, 32)], dim=1)[:, : x.shape[1]]
    assert torch.equal(qlinear_int8(wide, qw, lib), qlinear_int8(x, qw, lib))


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"])
def test_row_tails_sharing_a_chunk_give_each_row_its_own_bits(lib, qtype: str) -> None:
    """With nb % 8 = t blocks left per weight row, 8 // t rows' tails go in one chunk (row
    counts that do not divide the threads' shares included): the scalar reference's bits for
    every row, on this host's build and the other SIMD path's; K = 576 is the default model's."""
    builds = [lib, _other_simd_build(lib)] if lib.qgemm_simd_level() else [lib]
    for t in (1, 2, 3, 4, 6, 7):
        for m in (1, 2, 6):
            qw, x, raw = _case(qtype, m, seed=4, k=32 * (8 + t))
            want = _ref(lib, qw, x, interleaved=False)
            w = dequantize(raw, GGMLQuantizationType[qtype]).astype(np.float64)
            xq = q8_rows(x.numpy()).astype(np.float64)
            assert (np.abs(want.numpy() - xq @ w.T) <= 2e-6 * (np.abs(xq) @ np.abs(w).T) + 1e-6).all()
            for b in builds:
                assert torch.equal(qlinear_int8(x, qw, b), want), (t, m)
    qw, x, _ = _case(qtype, 1, seed=5, k=576)
    assert torch.equal(qlinear_int8(x, qw, lib), _ref(lib, qw, x, interleaved=False))


def _packed(lib, qw: QuantizedWeight, x: torch.Tensor, threads: int,
            packed: torch.Tensor | None = None) -> torch.Tensor:
    """The few-row path with the weights' repacked copy beside them, as the decode step has."""
    n, k = qw.shape
    qt = QTYPES[qw.qtype][0]
    if packed is None:
        packed = torch.empty(lib.qgemm_pack_bytes(qt, n, k), dtype=torch.uint8)
        assert lib.qgemm_pack(qt, qw.data.data_ptr(), n, k, qw.data.shape[1], packed.data_ptr()) == 0
    m = x.shape[0]
    out = torch.empty(m, n)
    buf = scratch(lib.qgemm_scratch_bytes(m, k))
    assert lib.qgemm_q8_packed(qt, qw.data.data_ptr(), packed.data_ptr(), n, k, qw.data.shape[1],
                               x.data_ptr(), k, m, out.data_ptr(), buf.data_ptr(), threads) == 0
    return out


def _other_simd_build(lib):
    """The SIMD path this host's build does not take: the VNNI code with dpbusd emulated
    on an AVX2 host, the AVX2 code (maddubs) on a VNNI host."""
    if lib.qgemm_simd_level() == 1:
        other = require_kernel("decode_step", load_decode_step(("-DQG_EMULATE_VNNI",)))
        assert other.qgemm_simd_level() == 2
    else:
        other = require_kernel("decode_step", load_decode_step(("-mno-avx512vnni", "-mno-avxvnni")))
        assert other.qgemm_simd_level() == 1
    return other


def _simd_builds(lib) -> list:
    """This host's build and the other SIMD path's, and on a host whose build runs the
    repacked kernel at 512 bits (level 3) also its 256-bit VNNI build (level 2)."""
    if lib.qgemm_simd_level() == 0:
        return [lib]
    builds = [lib, _other_simd_build(lib)]
    if lib.qgemm_simd_level() == 3:
        narrow = require_kernel("decode_step", load_decode_step(("-DQG_NO_W512",)))
        assert narrow.qgemm_simd_level() == 2
        builds.append(narrow)
    return builds


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K"])
def test_repacked_rows_give_the_scalar_references_bits(lib, qtype: str) -> None:
    """Weights repacked 8 rows at a time (the decode step's copy), every type: every row's
    bits equal the scalar reference's on the original layout, with 1-3 threads whose shares
    of 40 rows end inside a group of 8 (those rows read the original), K with and without a
    partial chunk of blocks (K-quants: 1-3 super-blocks), on this host's build and the
    other SIMD path's (AVX2 or VNNI; where the host's runs the copy's kernel at 512 bits,
    in pairs of groups, also the 256-bit VNNI build; 3 threads' shares of 5 groups give
    pairs, a pair's second group alone and an odd last group); row-major at every row
    count (a model whose weights all have the copy), past 64 rows in passes of 64 (65: a pass of one row after a whole
    one, 129: after two)."""
    builds = _simd_builds(lib)
    rng = np.random.default_rng([*qtype.encode(), 6])
    for k in (256, 512, 768) if qtype in ("Q4_K", "Q5_K", "Q6_K") else (160, 256, 576):
        raw = random_blocks(qtype, 40, k, rng)
        qw = QuantizedWeight(qtype, torch.from_numpy(raw), (40, k))
        w = dequantize(raw, GGMLQuantizationType[qtype]).astype(np.float64)
        for m in (1, 2, 3, 6, 7, 9, 17, 64, 65, 129):
            x = torch.from_numpy(rng.standard_normal((m, k)).astype(np.float32))
            x[:, 3] *= 40
            want = _ref(lib, qw, x, interleaved=m >= 7)
            xq = q8_rows(x.numpy()).astype(np.float64)
            assert (np.abs(want.numpy() - xq @ w.T) <= 2e-6 * (np.abs(xq) @ np.abs(w).T) + 1e-6).all()
            for b in builds:
                for threads in (1, 2, 3):
                    assert torch.equal(_packed(b, qw, x, threads), want), (k, m, threads)


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_1", "Q6_K"])
def test_activations_quantized_16_blocks_at_once_keep_the_portable_bits(lib, qtype: str) -> None:
    """512-bit builds quantize a row's activations 16 blocks at once (their maxima and sums
    folded together): every block's bytes, scale, sum and Q6_K offsets as the portable
    build's one block at a time, in both copies the repacked kernel reads (row-major, and
    block by block from 16 rows); blocks of zeros, one negative value, tiny and huge
    values; K of 40 blocks (two runs of 16 and 8 one by one), 1, 17 and 70 rows."""
    portable = require_kernel("decode_step", load_decode_step(PORTABLE))
    rng = np.random.default_rng([*qtype.encode(), 9])
    k = 1280
    raw = random_blocks(qtype, 24, k, rng)
    qw = QuantizedWeight(qtype, torch.from_numpy(raw), (24, k))
    for m in (1, 17, 70):
        x = torch.from_numpy(rng.standard_normal((m, k)).astype(np.float32))
        x[:, 5] *= 40
        x[0, 32 * 3:32 * 4] = 0  # a block of zeros: scale 0
        x[0, 32 * 17:32 * 18] = 0
        x[0, 32 * 17 + 9] = -5.0  # its max a negative value
        x[m - 1, 32 * 20:32 * 21] *= 1e-30
        x[m - 1, 32 * 31:32 * 32] *= 1e30
        if m > 1:
            x[1] = 0
        want = _ref(portable, qw, x, interleaved=False)
        assert torch.isfinite(want).all()
        for b in _simd_builds(lib):
            assert torch.equal(_packed(b, qw, x, 2), want), m


@pytest.mark.parametrize("qtype", ["Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K"])
def test_every_threads_share_reads_the_repacked_copy(lib, qtype: str) -> None:
    """With the copy zeroed, every row comes out zero whatever the thread count: the rows
    are shared out in whole groups of 8 (40 rows over 3 threads: 0-7, 8-23, 24-39, not
    0-12, 13-25, 26-39), so no share cuts a group and reads the original blocks for it."""
    rng = np.random.default_rng(7)
    k = 256
    raw = random_blocks(qtype, 40, k, rng)
    qw = QuantizedWeight(qtype, torch.from_numpy(raw), (40, k))
    x = torch.from_numpy(rng.standard_normal((2, k)).astype(np.float32))
    want = _ref(lib, qw, x, interleaved=False)
    assert (want != 0).all()
    zeros = torch.zeros(lib.qgemm_pack_bytes(QTYPES[qtype][0], 40, k), dtype=torch.uint8)
    for threads in (1, 2, 3, 4):
        got = _packed(lib, qw, x, threads, packed=zeros)
        if lib.qgemm_simd_level() == 0:  # the scalar fallback has no few-row path of its own
            assert torch.equal(got, want)
        else:
            assert (got == 0).all(), threads
        assert torch.equal(_packed(lib, qw, x, threads), want), threads


def test_repacking_refuses_what_it_cannot_lay_out(lib) -> None:
    rng = np.random.default_rng(8)
    for qtype, n in (("Q4_1", 37), ("Q8_0", 36), ("Q4_K", 44), ("Q6_K", 44)):
        k = 256
        raw = torch.from_numpy(random_blocks(qtype, n, k, rng))
        out = torch.empty(2 * raw.numel(), dtype=torch.uint8)
        assert lib.qgemm_pack(QTYPES[qtype][0], raw.data_ptr(), n, k, raw.shape[1], out.data_ptr()) == -1
    raw = torch.from_numpy(random_blocks("Q4_1", 40, 256, rng))
    out = torch.empty_like(raw)
    assert lib.qgemm_pack(99, raw.data_ptr(), 40, 256, raw.shape[1], out.data_ptr()) == -1
    assert lib.qgemm_pack_bytes(99, 40, 256) == -1
    # the 512-bit kernel's copy pairs the groups of 8 rows: an odd last one with 8 zero rows
    rows = 48 if lib.qgemm_simd_level() == 3 else 40
    assert lib.qgemm_pack_bytes(QTYPES["Q6_K"][0], 40, 512) == rows * 2 * 210
    # Q4_K's copy unpacks each row's 12 bytes of 6-bit scales: 148 bytes a super-block
    assert lib.qgemm_pack_bytes(QTYPES["Q4_K"][0], 40, 512) == rows * 2 * 148
    assert lib.qgemm_pack_bytes(QTYPES["Q4_1"][0], 40, 512) == rows * 16 * 20
    assert lib.qgemm_pack_bytes(QTYPES["Q4_1"][0], 32, 512) == 32 * 16 * 20


def test_this_host_takes_the_simd_path(lib) -> None:
    with open("/proc/cpuinfo") as f:
        flags = next(line for line in f if line.startswith("flags")).split()
    level = lib.qgemm_simd_level()
    if "avx2" in flags and "fma" in flags and "f16c" in flags:
        avx512 = all(f in flags for f in ("avx512_vnni", "avx512vl", "avx512bw", "avx512dq"))
        vnni = "avx512_vnni" in flags and "avx512vl" in flags or "avx_vnni" in flags
        assert level == (3 if avx512 else 2 if vnni else 1)
    else:
        assert level == 0


@pytest.mark.parametrize("qtype", list(QTYPES))
def test_portable_build_gives_the_same_bits(lib, qtype: str) -> None:
    """The scalar fallback (built here without AVX) against this host's SIMD build."""
    portable = require_kernel("decode_step", load_decode_step(PORTABLE))
    assert portable.qgemm_simd_level() == 0
    for m in (1, 3, 8, 13):
        qw, x, _ = _case(qtype, m, seed=2)
        assert torch.equal(qlinear_int8(x, qw, portable), qlinear_int8(x, qw, lib)), m


@pytest.mark.parametrize("qtype", list(QTYPES))
def test_the_other_simd_path_gives_the_same_bits(lib, qtype: str) -> None:
    """The SIMD path this host's build does not take gives the same bits, both activation
    layouts: on an AVX2 host the VNNI build's own code (dpbusd accumulation, Q6_K's 32-bit
    scale lanes) with dpbusd emulated in scalar, on a VNNI host the AVX2 build's."""
    if lib.qgemm_simd_level() == 0:
        pytest.skip("this host has no AVX2: the VNNI paths build on the AVX2 ones")
    other = _other_simd_build(lib)
    for m in (1, 3, 8, 13):
        qw, x, _ = _case(qtype, m, seed=3)
        assert torch.equal(qlinear_int8(x, qw, other), qlinear_int8(x, qw, lib)), m


@pytest.mark.parametrize("flags", [("-mavx512f", "-mavx512vl", "-mavx512vnni"), ("-mavxvnni",)],
                         ids=["avx512-vnni", "avx-vnni"])
def test_vnni_paths_compile(lib, flags: tuple[str, ...]) -> None:
    """This host cannot run them; a build for a host that can must at least compile."""
    errors = compile_errors("decode_step", list(flags))
    assert errors is None, errors
    assert re.search(r"QG_DPBUSD", open(_src("qgemm.c")).read())


def _src(name: str) -> str:
    import os

    from kvserve.workers.model import cpu_kernels

    return os.path.join(os.path.dirname(cpu_kernels.__file__), "csrc", name)


def test_bad_shape_is_refused(lib) -> None:
    qw = QuantizedWeight("Q4_K", torch.zeros(2, 144, dtype=torch.uint8), (2, 256))
    bad = QuantizedWeight("Q4_K", qw.data, (2, 256))
    bad.shape = (2, 224)  # not a whole super-block
    with pytest.raises(RuntimeError, match="rejected"):
        qlinear_int8(torch.zeros(1, 224), bad, lib)
