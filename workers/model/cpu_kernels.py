"""Build and load the small C kernels in csrc/ on first use (gcc, OpenMP), via ctypes.

Plain C keeps the build to about a second (no torch headers), and one ctypes
call per layer replaces a Python-level loop over streams. If no compiler is
available the caller falls back to the pure-torch path, slower, and says so: each
kernel's state (`kernel_states`) is logged at start-up and shown in GetServerInfo, and
the tests fail (not skip) when a compiler is present but a build fails.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from functools import lru_cache

log = logging.getLogger(__name__)

_CSRC = os.path.join(os.path.dirname(__file__), "csrc")
# a call to an undeclared function is an error here, not an undefined symbol at load time
_BASE_FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC",
               "-Werror=implicit-function-declaration"]
# Every kernel is built alike, with no fused multiply-add the code does not ask for: the
# dequantized weights must match gguf's bit for bit (no fused d*q + m), and the decode
# step (decode_step.c, which includes paged_decode.c) must give a row the same bits as the
# op-by-op forward's separate kernels, so a request's tokens do not depend on the path.
_QGEMV_FLAGS = [*_BASE_FLAGS, "-ffp-contract=off"]
_FLAGS = _QGEMV_FLAGS


# each kernel's state once it was asked for: "C (<file>)", or why the torch path runs instead
_STATES: dict[str, str] = {}


def compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")


def kernel_states() -> dict[str, str]:
    """The state of every kernel built (or tried) so far in this process."""
    return dict(_STATES)


def build_failure(name: str) -> str | None:
    """Why a kernel did not build although a compiler is present and kernels are not turned
    off (KVSERVE_NO_C_KERNELS); None when it built, or could not have."""
    state = _STATES.get(name, "")
    return state.removeprefix("build failed: ") if state.startswith("build failed: ") else None


def _cache_dir() -> str:
    root = os.environ.get("KVSERVE_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "kvserve"
    )
    os.makedirs(root, exist_ok=True)
    return root


def _build(name: str, flags: list[str], deps: tuple[str, ...] = ()) -> ctypes.CDLL | None:
    """Compile csrc/<name>.c once per (source and the csrc files it includes, `deps`; flags;
    CPU) and load it; None if impossible."""
    if os.environ.get("KVSERVE_NO_C_KERNELS"):
        _STATES[name] = "torch (KVSERVE_NO_C_KERNELS is set)"
        return None
    cc = compiler()
    if cc is None:
        log.warning("no C compiler found: using the slower torch path instead of %s", name)
        _STATES[name] = "torch (no C compiler: install gcc for the faster C kernel)"
        return None
    src_path = os.path.join(_CSRC, f"{name}.c")
    src = b""
    for part in (f"{name}.c", *deps):
        with open(os.path.join(_CSRC, part), "rb") as f:
            src += f.read()
    key = hashlib.sha256(src + " ".join(flags).encode() + platform.machine().encode())
    key.update(_cpu_signature().encode())
    lib_path = os.path.join(_cache_dir(), f"{name}-{key.hexdigest()[:16]}.so")
    if not os.path.exists(lib_path):
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=_cache_dir())
        os.close(fd)
        try:
            subprocess.run([cc, *flags, src_path, "-o", tmp, "-lm"], check=True,
                           capture_output=True, timeout=120)
            os.replace(tmp, lib_path)  # atomic: concurrent builders never see a partial file
        except (subprocess.SubprocessError, OSError) as e:
            err = (getattr(e, "stderr", b"") or b"").decode(errors="replace")[:2000]
            log.error("building the C kernel %s failed (%s %s): using the slower torch path",
                      name, e, err)
            _STATES[name] = f"build failed: {e} {err}".strip()
            if os.path.exists(tmp):
                os.unlink(tmp)
            return None
    try:
        lib = ctypes.CDLL(lib_path)
    except OSError as e:  # built, but not loadable here (a missing symbol)
        log.error("loading the C kernel %s failed (%s): using the slower torch path", name, e)
        _STATES[name] = f"build failed: {e}"
        return None
    _STATES[name] = f"C ({os.path.basename(lib_path)})"
    return lib


@lru_cache(maxsize=2)
def load_paged_decode(extra_flags: tuple[str, ...] = ()) -> ctypes.CDLL | None:
    """The compiled decode-attention library, or None when it cannot be built here.
    `extra_flags` (tests): e.g. -DKV_NO_W512 builds the 256-bit form on an AVX-512 host."""
    lib = _build("paged_decode", [*_FLAGS, *extra_flags], deps=("fp16.h",))
    if lib is None:
        return None
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    for f in (lib.paged_decode_f32, lib.paged_decode_f16):  # a float32 or float16 cache
        f.argtypes = [p, p, p, p, p, p, i64, i64, i64, i64, i64, i64, ctypes.c_float, i64,
                      ctypes.c_float, ctypes.c_int]
        f.restype = ctypes.c_int
    lib.pd_kv16_fits.argtypes = [i64, i64]
    lib.pd_kv16_fits.restype = ctypes.c_int
    return lib


@lru_cache(maxsize=1)
def load_qgemv() -> ctypes.CDLL | None:
    """The compiled quantized-weight matmul (csrc/qgemv.c), or None."""
    lib = _build("qgemv", _QGEMV_FLAGS, deps=("fp16.h",))
    if lib is None:
        return None
    f = lib.qgemv_f32
    p, i64, c_int = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    f.argtypes = [c_int, p, i64, i64, i64, p, i64, p, c_int]
    f.restype = c_int
    return lib


_STEP_DEPS = ("qgemm.c", "qgemm_packed.h", "qgemv.c", "paged_decode.c", "fp16.h")


@lru_cache(maxsize=4)
def load_decode_step(extra_flags: tuple[str, ...] = ()) -> ctypes.CDLL | None:
    """The int8 matmul (csrc/qgemm.c) and the whole-step decode kernel (csrc/decode_step.c,
    which includes qgemm.c, qgemv.c and paged_decode.c), or None. `extra_flags` (tests):
    e.g. -mno-avx2 builds the portable path on this host."""
    lib = _build("decode_step", [*_QGEMV_FLAGS, *extra_flags], deps=_STEP_DEPS)
    if lib is None:
        return None
    lib.qgemm_simd_level.restype = ctypes.c_int
    p, i64, c_int = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    lib.qgemm_q8.argtypes = [c_int, p, i64, i64, i64, p, i64, i64, p, p, c_int]
    lib.qgemm_q8.restype = c_int
    lib.qgemm_pack.argtypes = [c_int, p, i64, i64, i64, p]
    lib.qgemm_pack.restype = c_int
    lib.qgemm_pack_bytes.argtypes = [c_int, i64, i64]
    lib.qgemm_pack_bytes.restype = i64
    lib.qgemm_q8_packed.argtypes = [c_int, p, p, i64, i64, i64, p, i64, i64, p, p, c_int]
    lib.qgemm_q8_packed.restype = c_int
    lib.qgemm_q8_ref.argtypes = [c_int, p, i64, i64, i64, p, i64, p, p]
    lib.qgemm_q8_ref.restype = c_int
    lib.qgemm_scratch_bytes.argtypes = [i64, i64]
    lib.qgemm_scratch_bytes.restype = i64
    lib.decode_step_scratch_bytes.argtypes = [p, i64]
    lib.decode_step_scratch_bytes.restype = i64
    lib.decode_step.argtypes = [p, p, i64, p, p, p, i64, p, p, i64, p, p, c_int]
    lib.decode_step.restype = c_int
    f32 = ctypes.c_float
    lib.ds_rms_norm_rows.argtypes = [p, i64, p, p, i64, i64, i64, f32, c_int]
    lib.ds_rms_norm_rows.restype = None
    lib.ds_rope_rows.argtypes = [p, i64, i64, i64, i64, p, p, p, i64, c_int]
    lib.ds_rope_rows.restype = None
    lib.ds_kv_half.argtypes = [p, i64, p]
    lib.ds_kv_half.restype = None
    lib.ds_act_rows.argtypes = [p, i64, i64, i64, p, i64, c_int]
    lib.ds_act_rows.restype = None
    return lib


def compile_errors(name: str, flags: list[str]) -> str | None:
    """Compile csrc/<name>.c with `flags` (another target's, say -mavx512vnni) without
    loading it: the compiler's errors, or None when it compiles. None without a compiler."""
    cc = compiler()
    if cc is None:
        return None
    with tempfile.TemporaryDirectory() as tmp:
        # -O0: whether it compiles, quickly (optimising it is the target host's job)
        r = subprocess.run([cc, *_QGEMV_FLAGS, *flags, "-O0", "-c", os.path.join(_CSRC, f"{name}.c"),
                            "-o", os.path.join(tmp, "check.o")], capture_output=True, timeout=120)
    return r.stderr.decode(errors="replace") if r.returncode != 0 else None


def _cpu_signature() -> str:
    # -march=native output is only valid on the CPU it was built for
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return hashlib.sha256(line.encode()).hexdigest()[:16]
    except OSError:
        pass
    return platform.processor()
