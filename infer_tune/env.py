"""The hardware and software report every result embeds, and the machine's measured memory bandwidth."""

from __future__ import annotations

import functools
import json
import os
import platform
import subprocess
import time
from pathlib import Path

import psutil
import torch

from infer_tune import __version__, atomic, paths


def cpu_family() -> str | None:
    """Vendor, family and model numbers (x86 `vendor_id`, `cpu family`, `model`), e.g. AuthenticAMD 25/1."""
    fields: dict[str, str] = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            key = key.strip()
            if key in ("vendor_id", "cpu family", "model", "CPU implementer", "CPU part") and key not in fields:
                fields[key] = value.strip()
            if not line.strip() and fields:
                break
    except OSError:
        return None
    if "vendor_id" in fields:
        return f"{fields['vendor_id']} family {fields.get('cpu family', '?')} model {fields.get('model', '?')}"
    if "CPU implementer" in fields:
        return f"arm implementer {fields['CPU implementer']} part {fields.get('CPU part', '?')}"
    return None


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def accelerator() -> str | None:
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        return f"{props.name} ({props.total_memory / 2**30:.0f} GiB)"
    return None


def git_revision() -> str | None:
    """The git revision of the infer-tune checkout, when it runs from one."""
    root = Path(__file__).resolve().parent.parent
    try:
        out = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True, timeout=5, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None if out.returncode == 0 else None


# ISA features that decide which low-bit kernels are fast (VNNI / AMX int8 GEMM, AVX-512)
ISA_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16", "avx_vnni", "amx_tile",
             "amx_int8", "amx_bf16", "asimd", "sve")


def cpu_flags() -> list[str]:
    """The ISA_FLAGS this CPU reports (x86 `flags` / Arm `Features` of /proc/cpuinfo)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                present = set(line.split(":", 1)[1].split())
                return [f for f in ISA_FLAGS if f in present]
    except OSError:
        pass
    return []


def torch_cpu_capability() -> str | None:
    try:
        return torch.backends.cpu.get_cpu_capability()
    except (AttributeError, RuntimeError):
        return None


def _boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return platform.node()


def machine_key() -> str:
    """Tells hosts apart: CPU, flags, cores, RAM, accelerator and this boot (two VMs with the same CPU
    name are different hosts; a reading from another host is never reused)."""
    return (f"{cpu_model()}|{','.join(cpu_flags())}|{os.cpu_count()}|{psutil.virtual_memory().total}|"
            f"{accelerator()}|{_boot_id()}")


def measure_bandwidth_gb_s(size_mb: int = 256, repeats: int = 5) -> float:
    """Best-of-`repeats` host memory bandwidth from a large tensor copy (bytes read + bytes written)."""
    src = torch.ones(size_mb * 2**20 // 4, dtype=torch.float32)
    dst = torch.empty_like(src)
    dst.copy_(src)  # first touch of the pages is not bandwidth
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter_ns()
        dst.copy_(src)
        best = min(best, time.perf_counter_ns() - start)
    return 2 * src.numel() * src.element_size() / best  # bytes/ns == GB/s


FAST_READS: list = []  # more ways to read the same bytes plainly: the native kernels register their stream_read


def register_read(read) -> None:
    """Add a plain read `read(list of uint8 tensors)` that `read_gb_s` times beside torch's sum (the native
    kernels register theirs when they load: this low layer imports nothing above it)."""
    if read not in FAST_READS:
        FAST_READS.append(read)


def read_gb_s(tensors: list[torch.Tensor], passes: int = 2) -> float | None:
    """GB/s of the fastest plain read of `tensors` now, of `passes` each way: torch's sum over each one's bytes
    (as int64 where they allow) and every registered read (`register_read`; where the native kernels are loaded,
    their `stream_read`: the bytes split over torch's threads and read as 4 streams of 64-byte loads, the decode
    GEMV's access pattern). A decode's ceiling must come from a read at least as fast as the decode's own: a torch
    sum alone read 1.02x slower than the int4 decode it bounded at 1B (docs/results.md). The rounds take one
    after each round, so a row's roofline ceiling comes from the same minutes as its decode; None without bytes."""
    views, raw_views = [], []
    for t in tensors:
        raw = t.reshape(-1).view(torch.uint8)
        raw_views.append(raw)
        try:
            views.append(raw.view(torch.int64))
        except RuntimeError:  # an odd size or offset: read as bytes
            views.append(raw)
    size = sum(v.numel() * v.element_size() for v in views)
    if not size:
        return None
    reads = [lambda: [v.sum() for v in views], *(functools.partial(read, raw_views) for read in FAST_READS)]
    best = float("inf")
    with torch.inference_mode():
        for _ in range(passes):
            for read in reads:
                start = time.perf_counter_ns()
                read()
                best = min(best, time.perf_counter_ns() - start)
    return size / max(best, 1)  # bytes/ns == GB/s


@functools.cache
def device_read_gb_s(device: str, size_mb: int = 1024, repeats: int = 5) -> float:
    """GB/s of the fastest of `repeats` plain reads (a sum) of a `size_mb` buffer in an accelerator's own memory:
    the roofline ceiling of a model whose weights live there (a host reading says nothing of HBM). Measured once
    per process and device; each read is timed between synchronizations."""
    dev = torch.device(device)
    buffer = torch.ones(size_mb * 2**20 // 8, dtype=torch.int64, device=dev)
    sync = getattr(torch, dev.type).synchronize
    best = float("inf")
    with torch.inference_mode():
        buffer.sum()  # the kernel's first launch is not bandwidth
        for _ in range(repeats):
            sync(dev)
            start = time.perf_counter_ns()
            buffer.sum()
            sync(dev)
            best = min(best, time.perf_counter_ns() - start)
    size = buffer.numel() * buffer.element_size()
    del buffer
    return size / max(best, 1)  # bytes/ns == GB/s


REVALIDATE_TOLERANCE = 0.4  # a quick check this far (either way) from the cached reading re-measures


def bandwidth_reading() -> dict:
    """{gb_s, measured_at, quick_check_gb_s, source}: the bandwidth measured once per machine (the machine key:
    CPU, flags, cores, RAM, boot), cached in `$INFER_TUNE_HOME/bandwidth.json`; every use re-validates the
    cached reading with a quick copy (128 MiB, tens of ms) and re-measures when the two disagree by more than
    REVALIDATE_TOLERANCE."""
    cache = paths.home() / "bandwidth.json"
    key = machine_key()
    try:
        stored = json.loads(cache.read_text())
        if stored.get("machine") == key:
            quick = measure_bandwidth_gb_s(size_mb=128, repeats=2)  # past the last-level cache
            if abs(quick / float(stored["gb_s"]) - 1) <= REVALIDATE_TOLERANCE:
                return {"gb_s": float(stored["gb_s"]), "measured_at": stored.get("measured_at"),
                        "quick_check_gb_s": quick, "source": "cache (re-validated)"}
    except (OSError, ValueError, KeyError, ZeroDivisionError):
        pass
    gb_s = measure_bandwidth_gb_s()
    when = time.strftime("%Y-%m-%dT%H:%M:%S")
    atomic.write_json(cache, {"machine": key, "gb_s": gb_s, "measured_at": when})
    return {"gb_s": gb_s, "measured_at": when, "quick_check_gb_s": None, "source": "measured"}


def collect_env(threads: int | None = None) -> dict:
    """The `env` block of a result document."""
    import transformers

    bandwidth = bandwidth_reading()
    return {
        "cpu": cpu_model(),
        "cpu_family": cpu_family(),
        "cpu_flags": cpu_flags(),
        "torch_cpu_capability": torch_cpu_capability(),
        "cores": psutil.cpu_count(logical=False) or os.cpu_count(),
        "logical_cpus": os.cpu_count(),
        "threads": threads if threads is not None else torch.get_num_threads(),
        "ram_bytes": psutil.virtual_memory().total,
        "os": f"{platform.system()} {platform.release()}",
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "accelerator": accelerator(),
        "mem_bandwidth_gb_s": bandwidth["gb_s"],
        "mem_bandwidth": bandwidth,
        "machine": machine_key(),
    }


def tool_info() -> dict:
    return {"name": "infer-tune", "version": __version__, "git_revision": git_revision()}
