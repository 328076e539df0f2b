"""HumanEval pass@1: run generated code against the problem's tests, only inside an OS sandbox.

Each program (`prompt + completion + test + check(entry_point)`) runs in a fresh temp directory
under bubblewrap (metrics/sandbox.py says exactly what is and is not isolated): no network, no home
or working directory, read-only system directories, a private /tmp, its own PID namespace, as an
unprivileged user, under rlimits (memory, CPU, file size, open files, processes). stdout is
discarded; stderr goes to a file capped by the file-size limit, of which the last line is kept.
The run is killed at the timeout (the whole namespace goes with it) and on Ctrl-C.

Where no sandbox works, `isolation="sandbox"` (the default) refuses with the install command.
`isolation="unsafe"` runs the program as the current user in its own process group, under the same
rlimits and a Python-level prelude that blocks the obvious calls: that keeps an honest model's
mistakes contained but is NOT a sandbox (it is bypassed by `import posix`, `ctypes` and others).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from infer_tune.metrics import sandbox

MEMORY_LIMIT_BYTES = 1 << 30
FILE_SIZE_LIMIT_BYTES = 1 << 20
OPEN_FILES_LIMIT = 64
PROCESS_LIMIT = 16
STDERR_TAIL_BYTES = 8192
KILL_WAIT_S = 5.0
ISOLATIONS = ("sandbox", "unsafe")

PRELUDE = '''\
import builtins, os, shutil, socket, subprocess
def _blocked(*args, **kwargs):
    raise PermissionError("blocked by infer-tune pass@k guard")
socket.socket = socket.create_connection = socket.socketpair = _blocked
subprocess.Popen = subprocess.run = subprocess.call = subprocess.check_output = _blocked
for _name in ("system", "popen", "fork", "forkpty", "kill", "killpg", "execv", "execve", "spawnv",
              "remove", "unlink", "rmdir", "removedirs", "rename", "replace", "putenv"):
    if hasattr(os, _name):
        setattr(os, _name, _blocked)
shutil.rmtree = shutil.move = _blocked
del _blocked, _name
'''

_FENCE = re.compile(r"```(?:python|py)?\s*\n(.*?)```", re.DOTALL)


@dataclass
class ItemResult:
    """Outcome of one completion: `status` is passed, failed, timeout or error (could not run)."""

    task_id: str
    passed: bool
    status: str
    detail: str = ""


def _field(problem: Any, name: str) -> Any:
    if isinstance(problem, dict):
        return problem.get(name) if name in problem else problem.get("extra", {}).get(name)
    if name in ("prompt", "text"):
        return getattr(problem, "text", None) or getattr(problem, "prompt", None)
    return getattr(problem, name, None) or getattr(problem, "extra", {}).get(name)


def build_program(prompt: str, completion: str, test: str, entry_point: str) -> str:
    """The program HumanEval runs: prompt + completion + tests + `check(entry_point)`.

    A chat model often answers with a fenced code block holding the whole function; then that block
    follows the prompt (redefining the function) instead of the raw completion.
    """
    fenced = _FENCE.search(completion)
    body = completion
    if fenced and f"def {entry_point}" in fenced.group(1):
        body = "\n" + fenced.group(1)
    return f"{prompt}{body}\n\n{test}\n\ncheck({entry_point})\n"


def _limits(timeout_s: float, memory_bytes: int):
    def apply() -> None:  # unsafe mode only (the sandbox sets its limits inside)
        import resource

        cpu = int(timeout_s) + 1
        for limit, value in ((resource.RLIMIT_AS, memory_bytes), (resource.RLIMIT_CPU, cpu),
                             (resource.RLIMIT_FSIZE, FILE_SIZE_LIMIT_BYTES), (resource.RLIMIT_NOFILE, OPEN_FILES_LIMIT),
                             (resource.RLIMIT_CORE, 0)):
            resource.setrlimit(limit, (value, value))

    return apply


def run_program(program: str, *, timeout_s: float = 5.0, memory_bytes: int = MEMORY_LIMIT_BYTES,
                isolation: str = "sandbox") -> tuple[str, str]:
    """Run `program` isolated as the module docstring says; returns (status, detail) with status
    passed / failed / timeout. Raises SandboxUnavailable when `isolation="sandbox"` has no sandbox."""
    if isolation not in ISOLATIONS:
        raise ValueError(f"isolation must be one of {ISOLATIONS}, got {isolation!r}")
    box = sandbox.require() if isolation == "sandbox" else None
    with tempfile.TemporaryDirectory(prefix="infer-tune-passk-") as tmp:
        work = Path(tmp) / "work"
        work.mkdir()
        script = work / "program.py"
        script.write_text(program if box else f"{PRELUDE}\n{program}", encoding="utf-8")
        stderr_path = Path(tmp) / "stderr"  # outside the sandbox's view; capped by the file-size limit
        with open(stderr_path, "wb") as stderr:
            if box is not None:
                box.prepare_workdir(work)
                limits = sandbox.Limits(cpu_s=int(timeout_s) + 1, memory_bytes=memory_bytes,
                                        file_bytes=FILE_SIZE_LIMIT_BYTES, open_files=OPEN_FILES_LIMIT,
                                        processes=PROCESS_LIMIT)
                proc = subprocess.Popen(box.command(work, "/tmp/program.py", limits), cwd=tmp,
                                        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=stderr,
                                        start_new_session=True)
            else:
                proc = subprocess.Popen([sys.executable, "-I", str(script)], cwd=work, env={},
                                        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=stderr,
                                        start_new_session=True, preexec_fn=_limits(timeout_s, memory_bytes))
            try:
                proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                _kill_group(proc)
                return "timeout", f"no result within {timeout_s:g} s"
            except BaseException:  # Ctrl-C: take the program down with us
                _kill_group(proc)
                raise
        if proc.returncode == 0:
            return "passed", ""
        return "failed", _last_line(stderr_path, proc.returncode)


def _last_line(path: Path, returncode: int) -> str:
    """The last non-empty line of the (bounded) stderr file, read from its tail only."""
    with open(path, "rb") as handle:
        size = handle.seek(0, os.SEEK_END)
        handle.seek(max(0, size - STDERR_TAIL_BYTES))
        tail = handle.read().decode("utf-8", "replace")
    lines = [line for line in tail.strip().splitlines() if line.strip()]
    return (lines[-1] if lines else f"exit code {returncode}")[:500]


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL the process group (under bwrap, its death takes the namespace down), then reap it
    with a bounded wait: a descendant that escaped the group must not hang the run."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        proc.wait(timeout=KILL_WAIT_S)
    except subprocess.TimeoutExpired:
        pass


def evaluate(problems: Sequence[Any], completions: Sequence[str], *, timeout_s: float = 5.0,
             isolation: str = "sandbox") -> list[ItemResult]:
    """Per-item outcomes. `problems` are HumanEval rows (dicts with prompt, test, entry_point, task_id)
    or suite `Prompt`s (text + extra test / entry_point). `isolation`: see `run_program`."""
    if len(problems) != len(completions):
        raise ValueError(f"{len(problems)} problems but {len(completions)} completions")
    items = []
    for i, (problem, completion) in enumerate(zip(problems, completions, strict=True)):
        task_id = str(_field(problem, "task_id") or _field(problem, "id") or i)
        test, entry_point = _field(problem, "test"), _field(problem, "entry_point")
        if not test or not entry_point:
            items.append(ItemResult(task_id, False, "error", "problem has no test / entry_point"))
            continue
        program = build_program(_field(problem, "prompt") or "", completion or "", test, entry_point)
        status, detail = run_program(program, timeout_s=timeout_s, isolation=isolation)
        items.append(ItemResult(task_id, status == "passed", status, detail))
    return items


def score(items: Sequence[ItemResult]) -> float:
    """Share of items that passed (pass@1 with one greedy sample per problem)."""
    return sum(item.passed for item in items) / len(items) if items else 0.0


def pass_at_1(problems: Sequence[Any], completions: Sequence[str], timeout_s: float = 5.0,
              isolation: str = "sandbox") -> float:
    """pass@1 of one completion per problem; use `evaluate` for the per-item outcomes."""
    return score(evaluate(problems, completions, timeout_s=timeout_s, isolation=isolation))
