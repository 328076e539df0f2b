"""The project's own C++ CPU kernels, compiled for this host on first use and cached.

Two ops in one library (`torch.ops.infer_tune_native`):
- `w4a8_mm`, `w8a8_mm` (matmul.cpp): int4 / int8 weights x int8 activations, the kernels of `Int4A8Linear`
  and `Int8A8Linear` (tuners/quantize/modules.py; quantize's `activations: int8`);
- `decode_attention` (attention.cpp): one new token per row attending over a KV cache, what the
  compiled lean step (and the batched slot step) attends with (attention.py).

`load()` builds them with `torch.utils.cpp_extension` (`-O3 -march=native`: compiled for the CPU in front
of it, so the AVX2 paths exist exactly where the CPU has AVX2; `-fopenmp`: `at::parallel_for` splits the
work over torch's own OpenMP threads, the libgomp torch loaded, instead of running on one) into
`$INFER_TUNE_HOME/kernels/native-<key>/`, where the key covers the sources, torch, Python and every ISA
flag this CPU reports; later processes load the cached library (about 25 s to compile on 2 cores, milliseconds to
load). Each op has a fake implementation, so a compiled graph holds it as one extern call.

No C++ compiler, or a failed build: `available()` says why, once per process (a failed build is not
retried per call); the kernel screen then drops `w4a8` (its reason recorded), the lean step attends with
SDPA, and a config that forces `w4a8` fails with that line. `INFER_TUNE_NO_NATIVE=1` turns them off.
`INFER_TUNE_NATIVE_MARCH=haswell` (any `-march` value) compiles for that target instead of `native`: the AVX2
paths on an AVX-512 host, `x86-64` the scalar ones (how the tests reach every path on one machine; the key
covers it, so each target keeps its own library).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import platform
import shutil
import sys
from pathlib import Path

import torch

from infer_tune.contenthash import sha256_of

SOURCES = tuple(Path(__file__).with_name(name) for name in ("matmul.cpp", "attention.cpp", "step.cpp"))
HEADERS = (Path(__file__).with_name("kernels.h"),)  # in the build key, not compiled on their own
NAME = "infer_tune_native"
DISABLE_ENV = "INFER_TUNE_NO_NATIVE"
MARCH_ENV = "INFER_TUNE_NATIVE_MARCH"


def march() -> str:
    """The `-march` the library is compiled for: `native` unless INFER_TUNE_NATIVE_MARCH names another."""
    return os.environ.get(MARCH_ENV, "").strip() or "native"


class KernelUnavailable(RuntimeError):
    """The native kernels cannot run here (no compiler, a failed build, or turned off)."""


def build_key(sources: list[bytes]) -> str:
    """What the compiled library depends on: the sources, torch, Python, the CPU's whole ISA (`-march=native`
    uses every extension the CPU reports: two CPU generations that differ only in avx512vl, bmi2 or vbmi must
    not share a library, or the older one dies with SIGILL)."""
    parts = [hashlib.sha256(b"".join(sources)).hexdigest()[:16], torch.__version__, platform.python_version(),
             platform.machine(), ",".join(all_cpu_flags())]
    if march() != "native":
        parts.append(f"march={march()}")
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:16]


def all_cpu_flags(cpuinfo: str | None = None) -> list[str]:
    """Every flag of the first CPU in /proc/cpuinfo (x86 `flags`, Arm `Features`), sorted; [] where unreadable."""
    try:
        text = cpuinfo if cpuinfo is not None else Path("/proc/cpuinfo").read_text()
    except OSError:
        return []
    for line in text.splitlines():
        if line.startswith(("flags", "Features")):
            return sorted(set(line.split(":", 1)[1].split()))
    return []


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
    from infer_tune import env

    env.register_read(torch.ops.infer_tune_native.stream_read)  # the roofline probe's fast read (env.read_gb_s)
    return True, torch.ops.infer_tune_native.isa()


def _build() -> None:
    from infer_tune import paths

    if shutil.which(os.environ.get("CXX", "c++")) is None:
        raise KernelUnavailable("no C++ compiler (c++) on PATH to build the native kernels")
    folder = paths.home() / "kernels" / f"native-{build_key([s.read_bytes() for s in SOURCES + HEADERS])}"
    try:
        build_library(folder, NAME, SOURCES, extra_cflags=["-O3", f"-march={march()}", "-fopenmp"],
                      extra_ldflags=["-fopenmp"])
    except KernelUnavailable:
        raise
    except Exception as exc:  # a compiler error, no ninja, a header mismatch: the kernels are not offered
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[-1][:200]
        raise KernelUnavailable(f"the native kernels did not build here: {first}") from None


def build_library(folder: Path, name: str, sources, *, extra_cflags=(), extra_ldflags=()) -> Path:
    """Build (or reuse) the extension `name` in `folder` and load it into this process; returns the folder used.

    Nothing another account could have written is loaded (docs/hardening.md): `folder` is made private
    (0700) and every path from `$INFER_TUNE_HOME` down to it must be this user's and not group/other
    writable, else the library is built into a fresh private temp folder instead (removed at exit). The
    build writes the sha256 of the library next to it (`<name>.so.sha256`); a cached library whose digest
    is missing or differs (truncated, swapped, half-written) is removed with its objects and built again
    before anything is loaded."""
    from torch.utils import cpp_extension

    from infer_tune import paths

    problem = None
    try:
        paths.private_dir(folder)
        problem = paths.untrusted(folder)
    except OSError as exc:
        problem = f"{folder} cannot be made: {exc.strerror or exc}"
    if problem:
        folder = _private_temp_folder()
        print(f"note: not using the cached native kernels ({problem}); building them into {folder}",
              file=sys.stderr)
    library = folder / f"{name}.so"
    digest_file = folder / f"{name}.so.sha256"
    with _builder_lock(folder):
        # torch's own lock (`lock`, made with O_EXCL and removed by its builder) outlives a killed builder and
        # then makes every later load wait forever; holding ours, no other builder of this folder is alive
        (folder / "lock").unlink(missing_ok=True)
        if library.exists() and (not problem and (paths.untrusted(library) or paths.untrusted(digest_file))
                                 or not _digest_matches(library, digest_file)):
            _clear_build(folder)  # a file of another account, or not the library this folder's build wrote
        cpp_extension.load(name=name, sources=[str(s) for s in sources], build_directory=str(folder),
                           is_python_module=False, extra_cflags=list(extra_cflags),
                           extra_ldflags=list(extra_ldflags), verbose=False)
        if not digest_file.exists():  # just built by this process in a folder only this user can write
            from infer_tune.atomic import write_text

            write_text(digest_file, sha256_of(library) + "\n")
    return folder


@contextlib.contextmanager
def _builder_lock(folder: Path):
    """One builder per folder: an flock on `build.flock` (the kernel drops it when its holder dies, however it
    dies, so a killed build never blocks the next). The holder's pid is written in it for the waiting line."""
    import fcntl

    fd = os.open(folder / "build.flock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
            print(f"waiting for process {holder}, which is building the native kernels in {folder}",
                  file=sys.stderr)
            fcntl.flock(fd, fcntl.LOCK_EX)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        yield
    finally:
        os.close(fd)  # releases the flock


def _digest_matches(library: Path, digest_file: Path) -> bool:
    try:
        return digest_file.read_text().strip() == sha256_of(library)
    except OSError:
        return False


def _clear_build(folder: Path) -> None:
    """Remove what a build left in `folder` (library, digest, objects, ninja files) so the next one starts clean."""
    for item in folder.iterdir():
        if item.name.startswith("build.flock"):
            continue
        if item.is_dir() and not item.is_symlink():
            shutil.rmtree(item, ignore_errors=True)
        else:
            item.unlink(missing_ok=True)


def _private_temp_folder() -> Path:
    import atexit
    import tempfile

    folder = Path(tempfile.mkdtemp(prefix="infer-tune-kernels-"))  # 0700, this user's
    atexit.register(shutil.rmtree, folder, True)  # the loaded library stays mapped; its file can go
    return folder


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
