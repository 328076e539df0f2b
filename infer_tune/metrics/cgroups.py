"""A cgroup (v2) per sandboxed program, where the host allows one: a memory limit (swap 0) and a process
limit over the whole program with all its children, which per-process rlimits cannot give.

Used by metrics/sandbox.py when infer-tune runs as root on a host whose /sys/fs/cgroup is a cgroup v2
mount with the memory and pids controllers available to infer-tune's own cgroup. On any other host
(cgroup v1 or hybrid, no delegation, not root) `create` returns None and the sandbox says so in its
description; the program still gets its rlimits and a bounded /tmp.
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


@dataclass
class RunGroup:
    """One program's cgroup: `procs` is the file a child writes itself into before it execs."""

    path: Path

    @property
    def procs(self) -> str:
        return str(self.path / "cgroup.procs")

    def peak_bytes(self) -> int | None:
        with contextlib.suppress(OSError, ValueError):
            return int((self.path / "memory.peak").read_text())
        return None

    def remove(self) -> None:
        """Kill whatever is left in it, then remove the folder (retried briefly while the kernel reaps)."""
        with contextlib.suppress(OSError):
            (self.path / "cgroup.kill").write_text("1")
        for _ in range(50):
            try:
                self.path.rmdir()
                return
            except FileNotFoundError:
                return
            except OSError:
                time.sleep(0.02)


def create(memory_bytes: int, processes: int) -> RunGroup | None:
    """A fresh cgroup with `memory.max` = memory_bytes (no swap) and `pids.max` = processes, or None."""
    base = parent()
    if base is None:
        return None
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


def join(procs_file: str) -> None:
    """Move the calling process into a cgroup (runs in the child between fork and exec)."""
    fd = os.open(procs_file, os.O_WRONLY)
    try:
        os.write(fd, b"0")
    finally:
        os.close(fd)


def clean_stale(base: Path) -> None:
    """Remove per-run cgroups whose process is gone (a parent killed with SIGKILL cannot remove its own)."""
    try:
        entries = list(base.iterdir())
    except OSError:
        return
    for entry in entries:
        match = _NAME.match(entry.name)
        if match and not pid_alive(int(match.group(1))):
            RunGroup(entry).remove()


