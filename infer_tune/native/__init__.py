"""The project's own C++ CPU kernels, compiled for this host on first use and cached.

Two ops in one library (`torch.ops.infer_tune_native`):
- `w4a8_mm`, `w8a8_mm` (matmul.cpp): int4 / int8 weights x int8 activations, the kernels of `Int4A8Linear`
  and `Int8A8Linear` (tuners/quantize/modules.py; quantize's `activations: int8`);
- `decode_attention` (attention.cpp): one new token per row attending over a KV cache, what the
  compiled lean step (and the batched slot step) attends with (attention.py).

`load()` builds them with `torch.utils.cpp_extension` (`-O3 -march=native`: compiled for the CPU in front
of it, so the AVX2 paths exist exactly where the CPU has AVX2; `-fopenmp`: `at::parallel_for` splits the
work over torch's own OpenMP threads, the libgomp torch loaded, instead of running on one) into
`$INFER_TUNE_HOME/kernels/native-<key>/`, where the key covers the sources, torch, Python and this CPU's
ISA flags; later processes load the cached library (about 25 s to compile on 2 cores, milliseconds to
load). Each op has a fake implementation, so a compiled graph holds it as one extern call.

No C++ compiler, or a failed build: `available()` says why, once per process (a failed build is not
retried per call); the kernel screen then drops `w4a8` (its reason recorded), the lean step attends with
SDPA, and a config that forces `w4a8` fails with that line. `INFER_TUNE_NO_NATIVE=1` turns them off.
"""

from __future__ import annotations

import functools
import hashlib
import os
import platform
import shutil
from pathlib import Path

import torch

SOURCES = tuple(Path(__file__).with_name(name) for name in ("matmul.cpp", "attention.cpp", "step.cpp"))
HEADERS = (Path(__file__).with_name("kernels.h"),)  # in the build key, not compiled on their own
NAME = "infer_tune_native"
DISABLE_ENV = "INFER_TUNE_NO_NATIVE"


class KernelUnavailable(RuntimeError):
    """The native kernels cannot run here (no compiler, a failed build, or turned off)."""


def build_key(sources: list[bytes]) -> str:
    """What the compiled library depends on: the sources, torch, Python, the CPU's ISA."""
    from infer_tune.env import cpu_flags

    parts = [hashlib.sha256(b"".join(sources)).hexdigest()[:16], torch.__version__, platform.python_version(),
             platform.machine(), ",".join(cpu_flags())]
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:16]


def available() -> tuple[bool, str]:
    """(whether the native kernels run here, the ISA their inner loops were compiled for or why not)."""
    return _load()


def w4a8() -> str:
    """Load (building once if needed) the native kernels; returns their ISA (`avx512`, `avx2` or `scalar`).
    Raises KernelUnavailable with the reason."""
    ok, detail = _load()
    if not ok:
        raise KernelUnavailable(detail)
    return detail


@functools.cache
def _load() -> tuple[bool, str]:
    if os.environ.get(DISABLE_ENV) == "1":
        return False, f"native kernels turned off ({DISABLE_ENV}=1)"
    try:
        if not hasattr(getattr(torch.ops, NAME), "w4a8_mm"):
            _build()
    except KernelUnavailable as exc:
        return False, str(exc)
    _register_fakes()
    return True, torch.ops.infer_tune_native.isa()


def _build() -> None:
    from infer_tune import paths

    if shutil.which(os.environ.get("CXX", "c++")) is None:
        raise KernelUnavailable("no C++ compiler (c++) on PATH to build the native kernels")
    folder = paths.home() / "kernels" / f"native-{build_key([s.read_bytes() for s in SOURCES + HEADERS])}"
    folder.mkdir(parents=True, exist_ok=True)
    try:
        from torch.utils import cpp_extension

        # torch's builder locks the folder (two processes compile once) and rebuilds only on a changed source
        cpp_extension.load(name=NAME, sources=[str(s) for s in SOURCES], build_directory=str(folder),
                           is_python_module=False, extra_cflags=["-O3", "-march=native", "-fopenmp"],
                           extra_ldflags=["-fopenmp"], verbose=False)
    except Exception as exc:  # a compiler error, no ninja, a header mismatch: the kernels are not offered
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[-1][:200]
        raise KernelUnavailable(f"the native kernels did not build here: {first}") from None


@functools.cache
def _register_fakes() -> None:
    @torch.library.register_fake(f"{NAME}::w4a8_mm")
    def _(x, packed, group):
        return x.new_empty(x.shape[0], packed.shape[0] * 8)

    @torch.library.register_fake(f"{NAME}::w8a8_mm")
    def _(x, packed, scale):
        return x.new_empty(x.shape[0], packed.shape[0] * 8)

    @torch.library.register_fake(f"{NAME}::decode_attention")
    def _(q, k, v, mask, scale):
        return q.new_empty(q.shape[0], 1, q.shape[1], q.shape[3])
