"""Peak resident memory of the measured region.

On Linux the kernel's high-water mark (VmHWM) is reset by writing 5 to /proc/self/clear_refs, so
the peak covers only the measured region, not model loading; elsewhere the process-lifetime peak
from getrusage is reported (and is an upper bound).
"""

from __future__ import annotations

import gc
import resource
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

_CLEAR_REFS = Path("/proc/self/clear_refs")
_STATUS = Path("/proc/self/status")


def reset_peak_rss() -> bool:
    """Reset the peak-RSS counter (and CUDA's peak allocation); False where the OS cannot."""
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    try:
        _CLEAR_REFS.write_text("5")
        return True
    except OSError:
        return False


def _status_bytes(field: str) -> int | None:
    """A `kB` field of /proc/self/status (VmRSS, VmHWM) in bytes; None off Linux."""
    try:
        for line in _STATUS.read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def current_rss_bytes() -> int:
    rss = _status_bytes("VmRSS")
    if rss is not None:
        return rss
    import psutil

    return int(psutil.Process().memory_info().rss)


_held = 0  # nesting depth of long_lived_heap()


@contextmanager
def long_lived_heap() -> Iterator[None]:
    """What is alive on entry (the imported libraries, the loaded model: some 380,000 objects after
    torch, transformers and a model) is set aside from the garbage collector until exit (`gc.freeze`),
    so the collection before every measured pass scans only what was made since: 0.23 s per collection
    before, of 52 s of a three-method sweep of a tiny model (160 passes) 38 s were spent there. Within it,
    what was alive on entry and is dropped meanwhile waits for the exit (`gc.unfreeze`) to be collected;
    the models a sweep prepares are made inside and collected as before. Nests; the outermost acts."""
    global _held
    if _held == 0:
        gc.collect()
        gc.freeze()
    _held += 1
    try:
        yield
    finally:
        _held -= 1
        if _held == 0:
            gc.unfreeze()


def release_and_reset_peak() -> int:
    """Free what earlier runs left (garbage, glibc's cached arenas), reset the peak, return current RSS.

    In a sweep one process measures config after config; without this, memory freed by the previous
    config but still held by the allocator would count in the next config's peak.
    """
    import ctypes

    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
    reset_peak_rss()
    return current_rss_bytes()


def peak_rss_bytes() -> int:
    hwm = _status_bytes("VmHWM")
    if hwm is not None:
        return hwm
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def reset_cuda_peak(device: str) -> None:
    """Start a new CUDA peak reading (a no-op off CUDA)."""
    if device.startswith("cuda") and torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()


def cuda_peak_bytes(device: str = "cuda") -> int | None:
    """Max bytes allocated on the GPU since the last reset (None off CUDA)."""
    if not device.startswith("cuda") or not torch.cuda.is_available():
        return None
    return int(torch.cuda.max_memory_allocated())


def is_out_of_memory(exc: BaseException) -> bool:
    """An allocation failure (CUDA OOM, or the CPU allocator refusing a request) rather than a bug."""
    if isinstance(exc, torch.OutOfMemoryError):
        return True
    text = str(exc).lower()
    return isinstance(exc, (RuntimeError, MemoryError)) and (
        isinstance(exc, MemoryError) or "out of memory" in text or "can't allocate memory" in text)
