"""An OS-level sandbox for generated code: bubblewrap (Debian package `bubblewrap`), probed once.

Each program runs as `python -I program.py` inside `bwrap` with:

- namespaces: a new network namespace (only a loopback that is down: no socket reaches anything),
  a new PID namespace (the program sees only itself; when it exits, or bwrap is killed, the kernel
  kills everything left in it, `setsid` grandchildren included), new IPC / UTS / cgroup namespaces,
  a new session (no terminal injection) and `--die-with-parent` (killing infer-tune kills it);
- filesystem: an empty root holding only /usr, /bin, /sbin, /lib*, /etc/ld.so.cache and the Python
  installation, all read-only; a private writable /tmp (an empty host temp dir, deleted afterwards)
  as HOME and working directory; a minimal /dev and the namespace's own /proc. The user's home,
  the working directory, /etc, /var, /run and the host's /tmp are not there at all;
- identity: as root, the program runs as `nobody` (uid 65534) with no capabilities; as another user,
  as that user mapped inside a new user namespace, with no capabilities;
- limits (set before exec, soft = hard): address space, CPU seconds, largest file written (stderr
  too, so a runaway writer stops at that size), open files, processes (RLIMIT_NPROC: a fork bomb
  stops there), no core files; stdout is discarded and stderr goes to a file, never a pipe.

Not isolated: the kernel itself (a kernel exploit escapes any namespace sandbox), CPU time up to
the timeout, and reading the read-only system directories listed above.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from infer_tune.errors import InferTuneError

INSTALL_HINT = "apt-get install bubblewrap"
NOBODY = 65534
SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
SYSTEM_FILES = ("/etc/ld.so.cache", "/etc/localtime")

# Runs first inside the sandbox (python -I -S): drop to nobody when started as root, set the limits,
# exec the program in a fresh interpreter (rlimits survive exec).
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
    """Per-program resource limits."""

    cpu_s: int = 6
    memory_bytes: int = 1 << 30
    file_bytes: int = 1 << 20
    open_files: int = 64
    processes: int = 16


@dataclass(frozen=True)
class Sandbox:
    """A working bubblewrap set-up: how to start it on this machine (found by `find`)."""

    bwrap: str
    python: str
    prefix: str
    drop_to: int  # uid/gid the launcher switches to (root only); 0: stay (user namespace)

    @property
    def description(self) -> str:
        who = "as nobody" if self.drop_to else "in a user namespace"
        return f"bubblewrap ({self.bwrap}, {who}; no network, read-only system dirs, private /tmp)"

    def command(self, workdir: Path, script: str, limits: Limits) -> list[str]:
        """The bwrap command line running `script` (a path inside the sandbox) under `limits`."""
        args = [self.bwrap, "--unshare-ipc", "--unshare-pid", "--unshare-net", "--unshare-uts",
                "--unshare-cgroup-try", "--die-with-parent", "--new-session", "--clearenv",
                "--setenv", "HOME", "/tmp", "--setenv", "PATH", "/usr/bin:/bin", "--setenv", "LANG", "C.UTF-8",
                "--setenv", "PYTHONHASHSEED", "0", "--hostname", "sandbox"]
        if self.drop_to:
            args += ["--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID"]
        else:
            args += ["--unshare-user", "--disable-userns", "--cap-drop", "ALL"]
        for path in SYSTEM_DIRS:
            if os.path.islink(path):
                args += ["--symlink", os.readlink(path), path]
            elif os.path.isdir(path):
                args += ["--ro-bind", path, path]
        for path in SYSTEM_FILES:
            if os.path.exists(path):
                args += ["--ro-bind", path, path]
        if not any(self.prefix == d or self.prefix.startswith(d + "/") for d in SYSTEM_DIRS):
            parents = []
            parent = os.path.dirname(self.prefix)
            while parent not in ("/", ""):
                parents.append(parent)
                parent = os.path.dirname(parent)
            for folder in reversed(parents):  # readable mount points for the dropped user
                args += ["--perms", "0755", "--dir", folder]
            args += ["--ro-bind", self.prefix, self.prefix]
        args += ["--dev", "/dev", "--proc", "/proc", "--bind", str(workdir), "/tmp", "--chdir", "/tmp"]
        args += [self.python, "-I", "-S", "-c", LAUNCHER, str(self.drop_to), str(limits.cpu_s),
                 str(limits.memory_bytes), str(limits.file_bytes), str(limits.open_files), str(limits.processes),
                 script]
        return args

    def prepare_workdir(self, workdir: Path) -> None:
        """Make the private /tmp writable by the user the program runs as."""
        if self.drop_to:
            os.chown(workdir, self.drop_to, self.drop_to)
            for item in workdir.iterdir():
                os.chown(item, self.drop_to, self.drop_to)


PROBE = """\
import os, socket, sys
if os.path.exists(sys.argv[1]):
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
print("sandbox-ok")
"""

_found: dict[int, Sandbox | str] = {}


def _interpreter() -> tuple[str, str]:
    """The real interpreter behind this one (a venv's base) and its installation prefix."""
    python = os.path.realpath(getattr(sys, "_base_executable", None) or sys.executable)
    return python, os.path.realpath(sys.base_prefix)


def _probe(candidate: Sandbox) -> str | None:
    """None when `candidate` runs a program with the promised isolation, else why not."""
    with tempfile.TemporaryDirectory(prefix="infer-tune-sandbox-probe-") as tmp:
        work = Path(tmp) / "work"
        work.mkdir()
        (work / "probe.py").write_text(PROBE, encoding="utf-8")
        secret = Path(tmp) / "host-only"
        secret.write_text("not for the sandbox")
        candidate.prepare_workdir(work)
        cmd = candidate.command(work, "/tmp/probe.py", Limits(cpu_s=10)) + [str(secret)]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=30, stdin=subprocess.DEVNULL)
        except (OSError, subprocess.SubprocessError) as exc:
            return f"{type(exc).__name__}: {exc}"
        if proc.returncode != 0 or "sandbox-ok" not in proc.stdout:
            lines = (proc.stderr or proc.stdout).strip().splitlines()
            return lines[-1] if lines else f"exit code {proc.returncode}"
    return None


def find() -> Sandbox | str:
    """The sandbox set-up that works here (probed once per process), or the reason none does."""
    euid = os.geteuid()
    if euid in _found:
        return _found[euid]
    bwrap = shutil.which("bwrap")
    if bwrap is None:
        _found[euid] = f"bubblewrap is not installed (`{INSTALL_HINT}`)"
        return _found[euid]
    python, prefix = _interpreter()
    candidate = Sandbox(bwrap=bwrap, python=python, prefix=prefix, drop_to=NOBODY if euid == 0 else 0)
    reason = _probe(candidate)
    _found[euid] = candidate if reason is None else f"bubblewrap cannot create its namespaces here ({reason})"
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
