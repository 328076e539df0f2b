"""An OS-level sandbox for generated code: bubblewrap (Debian package `bubblewrap`), probed once.

Each program runs as `python -I ...` inside `bwrap` with:

- namespaces: a fresh user namespace per run in which further user namespaces are disabled
  (`--unshare-user --disable-userns`; as root, bwrap itself is started as `nobody`, so the program is
  an unprivileged user outside the namespace too), a new network namespace (only a loopback that is
  down), a new PID namespace (when the program exits, or bwrap is killed, the kernel kills everything
  left in it, `setsid` grandchildren included), new IPC / UTS / cgroup namespaces, a new session and
  `--die-with-parent`; bwrap is started with an empty environment (PATH only) and the program's is
  cleared (`--clearenv`), so neither `os.environ` nor any `/proc/<pid>/environ` it can see holds the caller's;
- a seccomp filter (metrics/seccomp.py): no unshare / setns / mount, no keyrings, no System V shared
  memory or queues, no ptrace, bpf, io_uring, userfaultfd, no namespace flags on clone;
- filesystem: an empty root holding only /usr, /bin, /sbin, /lib*, /etc/ld.so.cache and the Python
  installation, all read-only; /tmp is a tmpfs of TMP_BYTES (HOME and working directory) holding the
  program, written there by bwrap from an unnamed file; a minimal /dev and the namespace's own /proc.
  Nothing of the host's /tmp, home, working directory, /etc, /var or /run is there;
- limits: a cgroup per run (v2, else a v1 memory controller; memory with no swap, process count) where
  the host allows one (metrics/cgroups.py; `Sandbox.memory_limit` says which, or `per process`), and always rlimits set before exec (soft = hard): address space, CPU seconds,
  largest file written, open files, processes, no core files. stdin, stdout and stderr are unnamed
  files of the caller (nothing is left in the temp directory, even if infer-tune is killed).

Where unprivileged user namespaces are off, a root caller falls back to bwrap run as root with the
launcher dropping to `nobody` (the seccomp filter still forbids new namespaces). Not isolated: the
kernel itself, CPU time up to the timeout, reading the read-only system directories listed above.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass

from infer_tune.errors import InferTuneError
from infer_tune.metrics import cgroups, seccomp

INSTALL_HINT = "apt-get install bubblewrap"
NOBODY = 65534
SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
SYSTEM_FILES = ("/etc/ld.so.cache", "/etc/localtime")
TMP_BYTES = 64 << 20  # the sandbox's whole /tmp (RAM-backed): files beyond it fail with ENOSPC
BWRAP_ENV = {"PATH": "/usr/bin:/bin"}  # all bwrap is started with (the program's own is set by --setenv)
NEEDED_OPTIONS = ("--disable-userns", "--seccomp", "--size", "--file", "--perms")

# Runs first inside the sandbox (python -I -S): drop to nobody where bwrap ran as root, set the limits,
# exec a fresh interpreter with the caller's arguments (rlimits survive exec).
LAUNCHER = """\
import os, resource, sys
drop, cpu, mem, fsize, nofile, nproc = (int(v) for v in sys.argv[1:7])
if drop:
    os.setgroups([]); os.setgid(drop); os.setuid(drop)
for name, value in (("RLIMIT_AS", mem), ("RLIMIT_CPU", cpu), ("RLIMIT_FSIZE", fsize),
                    ("RLIMIT_NOFILE", nofile), ("RLIMIT_NPROC", nproc), ("RLIMIT_CORE", 0)):
    resource.setrlimit(getattr(resource, name), (value, value))
os.execv(sys.executable, [sys.executable, "-I", *sys.argv[7:]])
"""


class SandboxUnavailable(InferTuneError):
    """No OS-level sandbox works on this machine and unsafe execution was not allowed."""


@dataclass(frozen=True)
class Limits:
    """Per-program resource limits (memory and processes also bound the run's cgroup, where there is one)."""

    cpu_s: int = 6
    memory_bytes: int = 1 << 30
    file_bytes: int = 1 << 20
    open_files: int = 64
    processes: int = 16


@dataclass(frozen=True)
class Sandbox:
    """A working bubblewrap set-up: how to start it on this machine (found by `find`).

    `mode`: `userns` (a fresh user namespace per run, bwrap started as `start_as` when that is not 0)
    or `drop` (bwrap as root, the launcher drops to nobody). `cgroup`: whether runs get a cgroup here."""

    bwrap: str
    python: str
    prefix: str
    mode: str = "userns"
    start_as: int = 0
    cgroup: bool = False
    cgroup_kind: str = ""  # "v2" or "v1" where runs get a cgroup

    @property
    def memory_limit(self) -> str:
        """What the memory limit holds for: `cgroup v2` / `cgroup v1` (the program with all its children) or
        `per process` (each process its own 1 GiB: children multiply it)."""
        return f"cgroup {self.cgroup_kind or 'v2'}" if self.cgroup else "per process"

    @property
    def description(self) -> str:
        who = ("as nobody in a fresh user namespace" if self.start_as else "in a fresh user namespace") \
            if self.mode == "userns" else "as nobody (bwrap as root: no user namespace here)"
        limits = (f"cgroup {self.cgroup_kind or 'v2'} memory/pids limit" if self.cgroup
                  else "no cgroup here: per-process limits")
        return (f"bubblewrap ({self.bwrap}, {who}; seccomp filter, no network, read-only system dirs, "
                f"{TMP_BYTES >> 20} MiB /tmp; {limits})")

    def command(self, args: list[str], limits: Limits, files: dict[str, int], seccomp_fd: int) -> list[str]:
        """The bwrap command line: `files` (path in /tmp -> readable fd) copied in, then `python -I *args`."""
        cmd = [self.bwrap, "--unshare-ipc", "--unshare-pid", "--unshare-net", "--unshare-uts",
               "--unshare-cgroup-try", "--die-with-parent", "--new-session", "--clearenv",
               "--setenv", "HOME", "/tmp", "--setenv", "PATH", "/usr/bin:/bin", "--setenv", "LANG", "C.UTF-8",
               "--setenv", "PYTHONHASHSEED", "0", "--hostname", "sandbox"]
        if self.mode == "userns":
            cmd += ["--unshare-user", "--disable-userns", "--cap-drop", "ALL"]
        else:
            cmd += ["--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID"]
        for path in SYSTEM_DIRS:
            if os.path.islink(path):
                cmd += ["--symlink", os.readlink(path), path]
            elif os.path.isdir(path):
                cmd += ["--ro-bind", path, path]
        for path in SYSTEM_FILES:
            if os.path.exists(path):
                cmd += ["--ro-bind", path, path]
        if not any(self.prefix == d or self.prefix.startswith(d + "/") for d in SYSTEM_DIRS):
            parents = []
            parent = os.path.dirname(self.prefix)
            while parent not in ("/", ""):
                parents.append(parent)
                parent = os.path.dirname(parent)
            for folder in reversed(parents):  # readable mount points for the unprivileged user
                cmd += ["--perms", "0755", "--dir", folder]
            cmd += ["--ro-bind", self.prefix, self.prefix]
        cmd += ["--dev", "/dev", "--proc", "/proc", "--perms", "1777", "--size", str(TMP_BYTES), "--tmpfs", "/tmp"]
        for path, fd in files.items():
            cmd += ["--perms", "0644", "--file", str(fd), path]
        cmd += ["--chdir", "/tmp", "--seccomp", str(seccomp_fd)]
        drop = NOBODY if self.mode == "drop" else 0
        cmd += [self.python, "-I", "-S", "-c", LAUNCHER, str(drop), str(limits.cpu_s), str(limits.memory_bytes),
                str(limits.file_bytes), str(limits.open_files), str(limits.processes), *args]
        return cmd

    def popen(self, args: list[str], files: dict[str, str], limits: Limits, *, stdin, stdout, stderr
              ) -> tuple[subprocess.Popen, cgroups.RunGroup | None]:
        """Start `python -I *args` in the sandbox with `files` (path in /tmp -> text) in place, in a new
        process group; also returns the run's cgroup (remove it after the wait) when there is one."""
        opened = []
        try:
            fds = {}
            for path, text in files.items():
                handle = tempfile.TemporaryFile()  # unnamed: nothing to clean up, whatever happens
                handle.write(text.encode("utf-8"))
                handle.seek(0)
                opened.append(handle)
                fds[path] = handle.fileno()
            rules = tempfile.TemporaryFile()
            rules.write(seccomp.program())
            rules.seek(0)
            opened.append(rules)
            group = cgroups.create(limits.memory_bytes, limits.processes) if self.cgroup else None
            procs, uid = (group.procs if group else None), self.start_as

            def before_exec() -> None:  # in the child, still as the caller: join the cgroup, then drop
                if procs:
                    cgroups.join(procs)
                if uid:
                    os.setgroups([])
                    os.setgid(uid)
                    os.setuid(uid)

            try:
                # bwrap itself gets no environment either: inside the PID namespace it is pid 1, and its
                # /proc/1/environ would hand the caller's (API keys included) to the program
                proc = subprocess.Popen(self.command(args, limits, fds, rules.fileno()), stdin=stdin, stdout=stdout,
                                        stderr=stderr, pass_fds=(*fds.values(), rules.fileno()), env=BWRAP_ENV,
                                        start_new_session=True, preexec_fn=before_exec, cwd="/")
            except BaseException:
                if group:
                    group.remove()
                raise
            return proc, group
        finally:
            for handle in opened:
                handle.close()


PROBE = """\
import ctypes, os, socket, sys
if os.path.exists("/etc/passwd"):
    raise SystemExit("host files visible")
try:
    open("/usr/.infer-tune-probe", "w")
    raise SystemExit("root filesystem writable")
except OSError:
    pass
open("/tmp/ok", "w").write("ok")
s = socket.socket()
try:
    s.connect(("127.0.0.1", 9))
    raise SystemExit("network reachable")
except OSError:
    pass
if ctypes.CDLL(None, use_errno=True).unshare(0x10000000) == 0:
    raise SystemExit("a new user namespace could be made")
print("sandbox-ok")
"""

_found: dict[int, Sandbox | str] = {}


def _interpreter() -> tuple[str, str]:
    """The real interpreter behind this one (a venv's base) and its installation prefix."""
    python = os.path.realpath(getattr(sys, "_base_executable", None) or sys.executable)
    return python, os.path.realpath(sys.base_prefix)


def _probe(candidate: Sandbox) -> str | None:
    """None when `candidate` runs a program with the promised isolation, else why not."""
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        try:
            proc, group = candidate.popen(["/tmp/probe.py"], {"/tmp/probe.py": PROBE}, Limits(cpu_s=10),
                                          stdin=subprocess.DEVNULL, stdout=out, stderr=err)
        except (OSError, subprocess.SubprocessError, seccomp.Unsupported) as exc:
            return f"{type(exc).__name__}: {exc}"
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            return "the probe did not finish within 30 s"
        finally:
            if group:
                group.remove()
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read(8192).decode(errors="replace"), err.read(8192).decode(errors="replace")
    if proc.returncode != 0 or "sandbox-ok" not in stdout:
        lines = (stderr or stdout).strip().splitlines()
        return lines[-1] if lines else f"exit code {proc.returncode}"
    return None


def _missing_options(bwrap: str) -> list[str]:
    try:
        text = subprocess.run([bwrap, "--help"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return list(NEEDED_OPTIONS)
    return [opt for opt in NEEDED_OPTIONS if opt not in text]


def find() -> Sandbox | str:
    """The sandbox set-up that works here (probed once per process), or the reason none does."""
    euid = os.geteuid()
    if euid in _found:
        return _found[euid]
    bwrap = shutil.which("bwrap")
    if bwrap is None:
        _found[euid] = f"bubblewrap is not installed (`{INSTALL_HINT}`)"
        return _found[euid]
    missing = _missing_options(bwrap)
    if missing:
        _found[euid] = f"bubblewrap at {bwrap} lacks {', '.join(missing)} (0.8.0 or newer is needed)"
        return _found[euid]
    python, prefix = _interpreter()
    cgroup_kind = cgroups.kind() or ""
    cgroup = bool(cgroup_kind)
    candidates = [Sandbox(bwrap, python, prefix, "userns", NOBODY if euid == 0 else 0, cgroup, cgroup_kind)]
    if euid == 0:
        # bwrap started as nobody cannot reach an interpreter under a private folder (/root/.pyenv):
        # the system's interpreter of the same version then, else bwrap as root dropping to nobody
        system = f"/usr/bin/python{sys.version_info.major}.{sys.version_info.minor}"
        if os.path.isfile(system) and os.path.realpath(system) != python:
            candidates.append(Sandbox(bwrap, os.path.realpath(system), "/usr", "userns", NOBODY, cgroup, cgroup_kind))
        candidates.append(Sandbox(bwrap, python, prefix, "drop", 0, cgroup, cgroup_kind))
    reasons = []
    for candidate in candidates:
        reason = _probe(candidate)
        if reason is None:
            _found[euid] = candidate
            return candidate
        reasons.append(reason)
    _found[euid] = f"bubblewrap cannot create its namespaces here ({'; '.join(dict.fromkeys(reasons))})"
    return _found[euid]


def available() -> bool:
    """Whether generated code can run sandboxed on this machine."""
    return isinstance(find(), Sandbox)


def require() -> Sandbox:
    """The working sandbox, or SandboxUnavailable naming the fix."""
    found = find()
    if isinstance(found, Sandbox):
        return found
    raise SandboxUnavailable(
        f"cannot run generated code safely: {found}. Install it (`{INSTALL_HINT}`) or, at your own risk, "
        "allow unsafe execution (unsafe_execute; it runs the code as you, with your files and network)")
