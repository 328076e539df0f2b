"""A cgroup per sandboxed program, where the host allows one (v2, else a writable v1 memory controller): a memory limit (swap 0) and a process
limit over the whole program with all its children, which per-process rlimits cannot give.

Used by metrics/sandbox.py when infer-tune runs as root on a host whose /sys/fs/cgroup is a cgroup v2
mount with the memory and pids controllers available to infer-tune's own cgroup; on cgroup v1 or hybrid
hosts as root, a v1 memory cgroup (swap counted where memsw exists) and a v1 pids cgroup where writable.
Elsewhere (not root, nothing writable) `create` returns None and the sandbox says so in its description
and the result row (`pass_at_1_memory_limit: per process`); the program still gets its rlimits.
Folders are named `infer-tune-passk-<pid>-<random>`; those of dead processes are removed at start.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import time
from dataclasses import dataclass
from pathlib import Path

from infer_tune.atomic import pid_alive

ROOT = Path("/sys/fs/cgroup")
PREFIX = "infer-tune-passk-"
_NAME = re.compile(rf"^{PREFIX}(\d+)-[0-9a-f]+$")


def _own_cgroup(root: Path) -> Path | None:
    """This process's cgroup v2 folder (the `0::PATH` line of /proc/self/cgroup)."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        if line.startswith("0::"):
            return root / line[3:].lstrip("/")
    return None


def parent() -> Path | None:
    """The folder under which per-run cgroups can be made here, or None (see module docstring)."""
    if os.geteuid() != 0 or not (ROOT / "cgroup.controllers").is_file():
        return None
    own = _own_cgroup(ROOT)
    if own is None or not own.is_dir():
        return None
    try:
        enabled = (own / "cgroup.subtree_control").read_text().split()
        if not {"memory", "pids"} <= set(enabled):
            (own / "cgroup.subtree_control").write_text("+memory +pids")
    except OSError:
        return None  # controllers not delegated, or the no-internal-processes rule: no cgroup here
    return own


def _v1_dir(controller: str) -> Path | None:
    """This process's cgroup v1 folder of `controller` (its mount point from /proc/mounts, its path from
    /proc/self/cgroup), or None where that controller has no v1 hierarchy."""
    try:
        mounts = Path("/proc/mounts").read_text().splitlines()
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    mount = next((Path(f[1]) for f in (m.split() for m in mounts)
                  if len(f) > 3 and f[2] == "cgroup" and controller in f[3].split(",")), None)
    if mount is None:
        return None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controller in controllers.split(","):
            folder = mount / path.lstrip("/")
            return folder if folder.is_dir() else None
    return None


def kind() -> str | None:
    """Which cgroup holds a whole sandboxed program here: "v2" (memory + pids), "v1" (a writable v1 memory
    controller, and pids where there is one), or None (the limits are per process)."""
    if parent() is not None:
        return "v2"
    if os.geteuid() == 0 and (memory := _v1_dir("memory")) is not None and os.access(memory, os.W_OK):
        return "v1"
    return None


@dataclass
class RunGroup:
    """One program's cgroup: `procs` are the files a child writes itself into before it execs (v1: one per
    hierarchy, memory first)."""

    path: Path
    extra: tuple[Path, ...] = ()
    version: int = 2

    @property
    def procs(self) -> list[str]:
        return [str(folder / "cgroup.procs") for folder in (self.path, *self.extra)]

    def peak_bytes(self) -> int | None:
        name = "memory.peak" if self.version == 2 else "memory.max_usage_in_bytes"
        with contextlib.suppress(OSError, ValueError):
            return int((self.path / name).read_text())
        return None

    def remove(self) -> None:
        """Kill whatever is left in it, then remove the folders (retried briefly while the kernel reaps)."""
        for folder in (self.path, *self.extra):
            if self.version == 2:
                with contextlib.suppress(OSError):
                    (folder / "cgroup.kill").write_text("1")
            for _ in range(50):
                if self.version == 1:  # no cgroup.kill in v1: SIGKILL each process left
                    with contextlib.suppress(OSError, ValueError):
                        for pid in (folder / "cgroup.procs").read_text().split():
                            with contextlib.suppress(OSError):
                                os.kill(int(pid), 9)
                try:
                    folder.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    time.sleep(0.02)


def create(memory_bytes: int, processes: int) -> RunGroup | None:
    """A fresh cgroup with the memory limit (no swap) and the process limit, or None."""
    base = parent()
    if base is None:
        return _create_v1(memory_bytes, processes)
    clean_stale(base)
    path = base / f"{PREFIX}{os.getpid()}-{secrets.token_hex(4)}"
    try:
        path.mkdir()
    except OSError:
        return None
    group = RunGroup(path)
    try:
        (path / "memory.max").write_text(str(memory_bytes))
        if (path / "memory.swap.max").exists():
            (path / "memory.swap.max").write_text("0")
        (path / "pids.max").write_text(str(processes))
    except OSError:
        group.remove()
        return None
    return group


def _create_v1(memory_bytes: int, processes: int) -> RunGroup | None:
    """cgroup v1 hosts (like hybrid ones without v2 controllers): a memory cgroup (`memory.limit_in_bytes`, and
    `memory.memsw.limit_in_bytes` the same where swap is accounted) and, where v1 pids is writable, `pids.max`."""
    if kind() != "v1":
        return None
    memory = _v1_dir("memory")
    clean_stale(memory, version=1)
    name = f"{PREFIX}{os.getpid()}-{secrets.token_hex(4)}"
    try:
        (memory / name).mkdir()
    except OSError:
        return None
    group = RunGroup(memory / name, version=1)
    try:
        (memory / name / "memory.limit_in_bytes").write_text(str(memory_bytes))
        if (memory / name / "memory.memsw.limit_in_bytes").exists():
            (memory / name / "memory.memsw.limit_in_bytes").write_text(str(memory_bytes))
    except OSError:
        group.remove()
        return None
    pids = _v1_dir("pids")
    if pids is not None and os.access(pids, os.W_OK):
        clean_stale(pids, version=1)
        try:
            (pids / name).mkdir()
            (pids / name / "pids.max").write_text(str(processes))
            group.extra = (pids / name,)
        except OSError:
            RunGroup(pids / name, version=1).remove()  # RLIMIT_NPROC still bounds the processes
    return group


def join(procs_files: list[str] | str) -> None:
    """Move the calling process into a cgroup (runs in the child between fork and exec)."""
    for procs_file in [procs_files] if isinstance(procs_files, str) else procs_files:
        fd = os.open(procs_file, os.O_WRONLY)
        try:
            os.write(fd, b"0")
        finally:
            os.close(fd)


def clean_stale(base: Path, version: int = 2) -> None:
    """Remove per-run cgroups whose process is gone (a parent killed with SIGKILL cannot remove its own)."""
    try:
        entries = list(base.iterdir())
    except OSError:
        return
    for entry in entries:
        match = _NAME.match(entry.name)
        if match and not pid_alive(int(match.group(1))):
            RunGroup(entry, version=version).remove()


