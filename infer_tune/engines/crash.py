"""A launch that dies is a result, not the end of a search (docs/tune.md, "Crashed launches").

An engine started by `engines.launch.started` can die where a Python exception cannot reach: SIGILL (an
instruction this CPU lacks, e.g. llama.cpp's AMX matmul built by GGML_NATIVE on a VM that hides AMX state),
SIGSEGV, SIGABRT (a GGML_ASSERT), SIGKILL from the kernel's OOM killer; or it hangs, never answering its
health check or its first request. `Crash` is what a result row keeps of it:

- `how`: `signal SIGILL (4)` (from the exit status; a shell that ran it reports 128 + the signal, read the
  same), `exit code N`, or `hung past N s`; `phase`: `start` (before it answered `/v1/models`), `first
  request` (the handshake, llama.cpp's first matmul) or `measurement` (during the rounds);
- `log_tail`: the last lines of the engine's own log (stdout and stderr), bounded: `LOG_LINES` lines of
  `LINE_CHARS` characters, read from the last `LOG_BYTES` bytes of the file;
- `reproducer`: the binary, its build (llama.cpp's source package, build number and commit), the argv, the
  sha256 of every model file it was given (a checkpoint folder: its tree digest) and this host's ISA flags
  (`env.cpu_flags`), with `line`: one shell line that runs it again, the facts as environment variables
  in front of the command.

`EngineCrashed` carries a Crash out of the launch; `Quarantine` holds the configurations that crashed (or
were refused) in one search, so none is started twice.

An in-process engine (OpenVINO) dies the same way, but inside infer-tune's own process, where nothing is left to
write the row. So each of its configurations runs first in a child process (`run_child`: the engine's `probe`,
`python -m infer_tune.engines.probe ENGINE ARGS`, builds it and decodes a few tokens) before it is loaded here:
a child killed by a signal, or silent past its deadline, is the configuration's Crash (phase `start`, the
reproducer that child's command line), the same row as a launch's; it never enters this process. An exception
the engine raises later, during the measured rounds (`exception_crash`: phase `measurement`, `how` and
`exception` the exception's type and first line, `log_tail` the traceback's last lines, the reproducer the same
child's command line), is the configuration's crashed row too: the search drops it and measures the rest
(scenarios/engine_tune.py `rounds_without_crashes`). A signal during the rounds still ends the run: the rounds
interleave every configuration in this one process.
"""

from __future__ import annotations

import shlex
import signal
from dataclasses import asdict, dataclass, field
from pathlib import Path

from infer_tune.errors import InferTuneError

LOG_LINES = 20
LINE_CHARS = 300
LOG_BYTES = 64 << 10
PHASES = ("start", "first request", "measurement")


@dataclass
class Crash:
    label: str
    settings: dict
    phase: str
    how: str  # "signal SIGILL (4)", "exit code 1", "hung past 3 s"
    signal: str | None = None
    signal_number: int | None = None
    exit_code: int | None = None
    hung_after_s: float | None = None
    exception: str | None = None  # "RuntimeError: ..." (an in-process engine raised during the rounds)
    log_tail: list[str] = field(default_factory=list)
    reproducer: dict = field(default_factory=dict)

    @property
    def summary(self) -> str:
        return f"crashed at {self.phase}: {self.how}"

    def to_dict(self) -> dict:
        return {**asdict(self), "summary": self.summary}


class EngineCrashed(InferTuneError):
    """A launched engine died or hung (its `crash` says how); exit code 1, not bad input."""

    exit_code = 1

    def __init__(self, crash: Crash, row: Path | None = None) -> None:
        line = crash.reproducer.get("line", "")
        super().__init__(f"{crash.label}: {crash.summary}" + (f" (its row: {row})" if row else "")
                         + (f"; reproduce: {line}" if line else ""))
        self.crash = crash


def signal_of(returncode: int | None) -> tuple[str, int] | None:
    """(name, number) of the signal an exit status says killed the process: a negative returncode (Popen),
    or 128 + N from a shell that ran it (N a real signal); None otherwise."""
    if returncode is None:
        return None
    number = -returncode if returncode < 0 else returncode - 128 if 128 < returncode < 128 + 65 else None
    if number is None:
        return None
    try:
        return signal.Signals(number).name, number
    except ValueError:
        return (f"signal {number}", number) if returncode < 0 else None


def describe_exit(returncode: int) -> tuple[str, dict]:
    """("signal SIGILL (4)" or "exit code 3", the fields of a Crash)."""
    found = signal_of(returncode)
    if found:
        name, number = found
        how = f"signal {name} ({number})"
        if name == "SIGKILL":
            how += ", not sent by infer-tune (the kernel's OOM killer is the usual sender)"
        return how, {"signal": name, "signal_number": number, "exit_code": returncode}
    return f"exit code {returncode}", {"exit_code": returncode}


def log_tail(path: Path | None, lines: int = LOG_LINES) -> list[str]:
    """The last `lines` non-empty lines of a log, each cut to LINE_CHARS, read from its last LOG_BYTES."""
    if path is None:
        return []
    try:
        with open(path, "rb") as f:
            f.seek(0, 2)
            size = f.tell()
            f.seek(max(0, size - LOG_BYTES))
            text = f.read().decode("utf-8", errors="replace")
    except OSError:
        return []
    kept = [ln.rstrip()[:LINE_CHARS] for ln in text.splitlines() if ln.strip()]
    return kept[-lines:]


def reproducer(launch, command: list[str], files: dict[str, Path] | None) -> dict:
    """What runs the crash again (module docstring): binary, build, argv, model digests, CPU flags, `line`."""
    from infer_tune import contenthash
    from infer_tune import env as envinfo

    build: dict = {}
    if isinstance(launch, InProcess):
        from infer_tune.engines.base import ENGINES

        build = ENGINES[launch.engine].identity() if launch.engine in ENGINES else {}
    elif launch.engine == "llama.cpp":
        from infer_tune.engines import llamacpp

        try:
            info = llamacpp.build_info()
        except Exception:  # noqa: BLE001 (a reproducer without the build facts is still one)
            info = {}
        build = {k: info.get(k) for k in ("source_package", "build_number", "commit", "flags") if info.get(k)}
    digests: dict[str, str] = {}
    for key, path in (files or {}).items():
        try:
            digests[key] = contenthash.file_digest(path)
        except OSError:
            digests[key] = "unreadable"
    if not files:
        model = Path(str(launch.model)).expanduser()
        try:
            digests["model"] = contenthash.tree_digest(model) if model.is_dir() else str(launch.model)
        except OSError:
            digests["model"] = str(launch.model)
    flags = envinfo.cpu_flags()
    facts = {"ENGINE_BUILD": " ".join(f"{k}={v}" for k, v in build.items()) or launch.engine,
             **{f"{k.upper()}_SHA256": v for k, v in digests.items()},
             "CPU_FLAGS": " ".join(flags)}
    line = " ".join(f"{k}={shlex.quote(str(v))}" for k, v in facts.items()) + " " + shlex.join(command)
    return {"binary": command[0] if command else None, "build": build, "argv": list(command[1:]),
            "model_sha256": digests, "cpu_flags": flags, "line": line}


def crash_of(launch, command: list[str], files, *, phase: str, returncode: int | None = None,
             hung_after_s: float | None = None, log_path: Path | None = None) -> Crash:
    """A Crash of `launch` (a returncode, or a hang of `hung_after_s`)."""
    if hung_after_s is not None:
        how, fields = f"hung past {hung_after_s:g} s", {"hung_after_s": hung_after_s}
    else:
        how, fields = describe_exit(int(returncode if returncode is not None else 0))
    return Crash(label=launch.label, settings=launch.to_dict()["settings"], phase=phase, how=how,
                 log_tail=log_tail(log_path), reproducer=reproducer(launch, command, files), **fields)


def exception_crash(target, exc: BaseException, command: list[str], files: dict[str, Path] | None = None, *,
                    phase: str = "measurement") -> Crash:
    """The Crash of an in-process engine's configuration that raised `exc` (module docstring): its traceback's
    last lines as the log's tail, `command` (the configuration's probe) as the reproducer."""
    import traceback

    first = str(exc).strip().splitlines()[0][:LINE_CHARS] if str(exc).strip() else ""
    what = f"{type(exc).__name__}: {first}" if first else type(exc).__name__
    lines = [ln.rstrip()[:LINE_CHARS] for chunk in traceback.format_exception(exc) for ln in chunk.splitlines()
             if ln.strip()]
    return Crash(label=target.label, settings=target.to_dict()["settings"], phase=phase, how=f"raised {what}",
                 exception=what, log_tail=lines[-LOG_LINES:], reproducer=reproducer(target, command, files))


@dataclass(frozen=True)
class InProcess:
    """One configuration of an in-process engine as the crash machinery names it (what `launch.Launch` is for a
    server): the engine, the model, its settings and its row's label."""

    engine: str
    model: str
    settings: dict
    label: str

    def to_dict(self) -> dict:
        return {"engine": self.engine, "model": self.model, "settings": {k: str(v) for k, v in self.settings.items()}}


@dataclass
class ChildEnd:
    """How a child process that ran an engine ended: `crash` (a signal or a hang), else its exit `code` and the
    last lines of its output (`tail`: why a non-zero exit refused the configuration)."""

    crash: Crash | None
    code: int | None
    tail: list[str]


def run_child(target, command: list[str], *, deadline_s: float, log_path: Path, files: dict[str, Path] | None = None,
              phase: str = "start", env: dict | None = None) -> ChildEnd:
    """Run `command` (a child that runs `target`, e.g. an `InProcess` configuration's probe) to its end or
    `deadline_s`, its output to `log_path`. Killed by a signal: a Crash; still running at the deadline: its process
    group killed and a Crash `hung past N s`; an exit code: no crash (the code and the log's tail)."""
    import os
    import subprocess

    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "wb") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                   start_new_session=True, env=env)
    try:
        code = process.wait(timeout=deadline_s)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        process.wait()
        return ChildEnd(crash_of(target, command, files, phase=phase, hung_after_s=deadline_s, log_path=log_path),
                        None, log_tail(log_path))
    if signal_of(code) is not None:
        return ChildEnd(crash_of(target, command, files, phase=phase, returncode=code, log_path=log_path), code,
                        log_tail(log_path))
    return ChildEnd(None, code, log_tail(log_path))


def is_crash(returncode: int | None, phase: str) -> bool:
    """Whether an ended process crashed: killed by a signal at any phase, or ended at all after it answered
    (an exit with a code before it answered is the engine refusing its arguments: a refused launch)."""
    return returncode is not None and (signal_of(returncode) is not None or phase != "start")


def key(launch) -> tuple:
    """What makes two launches the same configuration (the engine, the model, the settings)."""
    return launch.engine, str(launch.model), tuple(sorted(launch.to_dict()["settings"].items()))


class Quarantine:
    """The configurations of one search that crashed or were refused: none is started again."""

    def __init__(self) -> None:
        self._why: dict[tuple, str] = {}

    def add(self, launch, why: str) -> None:
        self._why.setdefault(key(launch), why)

    def why(self, launch) -> str | None:
        return self._why.get(key(launch))

    def __contains__(self, launch) -> bool:
        return key(launch) in self._why
