"""HumanEval pass@1: run generated code against the problem's tests, only in a limited subprocess.

Each program (`prompt + completion + test + check(entry_point)`) runs in a fresh temp directory as
`python -I` (isolated mode: no user site, no PYTHON* variables) with an empty environment, in its own
process group (killed whole on timeout), under these rlimits set before exec:

- RLIMIT_AS (address space, default 1 GiB), RLIMIT_CPU (CPU seconds, timeout + 1),
  RLIMIT_FSIZE (largest file it may write, 1 MiB), RLIMIT_NOFILE (64 open files), RLIMIT_CORE 0.

A prelude then disables the obvious escape hatches inside the interpreter (sockets, subprocesses,
fork, os.system, file deletion). That keeps an honest model's mistakes (infinite loops, memory
blow-ups, stray writes) contained; it is NOT a sandbox against hostile code: there is no network or
filesystem namespace. Run untrusted models' code inside a container without network.
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

MEMORY_LIMIT_BYTES = 1 << 30
FILE_SIZE_LIMIT_BYTES = 1 << 20
OPEN_FILES_LIMIT = 64

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
    return f"{PRELUDE}\n{prompt}{body}\n\n{test}\n\ncheck({entry_point})\n"


def _limits(timeout_s: float, memory_bytes: int):
    def apply() -> None:
        import resource

        cpu = int(timeout_s) + 1
        for limit, value in ((resource.RLIMIT_AS, memory_bytes), (resource.RLIMIT_CPU, cpu),
                             (resource.RLIMIT_FSIZE, FILE_SIZE_LIMIT_BYTES), (resource.RLIMIT_NOFILE, OPEN_FILES_LIMIT),
                             (resource.RLIMIT_CORE, 0)):
            resource.setrlimit(limit, (value, value))

    return apply


def run_program(program: str, *, timeout_s: float = 5.0, memory_bytes: int = MEMORY_LIMIT_BYTES) -> tuple[str, str]:
    """Run `program` under the limits above; returns (status, detail) with status passed/failed/timeout."""
    with tempfile.TemporaryDirectory(prefix="infer-tune-passk-") as tmp:
        script = Path(tmp) / "program.py"
        script.write_text(program, encoding="utf-8")
        proc = subprocess.Popen([sys.executable, "-I", str(script)], cwd=tmp, env={}, stdin=subprocess.DEVNULL,
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True,
                                preexec_fn=_limits(timeout_s, memory_bytes))
        try:
            _, stderr = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            return "timeout", f"no result within {timeout_s:g} s"
        if proc.returncode == 0:
            return "passed", ""
        lines = stderr.decode("utf-8", "replace").strip().splitlines()
        return "failed", (lines[-1] if lines else f"exit code {proc.returncode}")[:500]


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.communicate()


def evaluate(problems: Sequence[Any], completions: Sequence[str], *, timeout_s: float = 5.0) -> list[ItemResult]:
    """Per-item outcomes. `problems` are HumanEval rows (dicts with prompt, test, entry_point, task_id)
    or suite `Prompt`s (text + extra test / entry_point)."""
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
        status, detail = run_program(program, timeout_s=timeout_s)
        items.append(ItemResult(task_id, status == "passed", status, detail))
    return items


def score(items: Sequence[ItemResult]) -> float:
    """Share of items that passed (pass@1 with one greedy sample per problem)."""
    return sum(item.passed for item in items) / len(items) if items else 0.0


def pass_at_1(problems: Sequence[Any], completions: Sequence[str], timeout_s: float = 5.0) -> float:
    """pass@1 of one completion per problem; use `evaluate` for the per-item outcomes."""
    return score(evaluate(problems, completions, timeout_s=timeout_s))
