"""Result documents: one JSON record per (model, config, workload) run, written atomically.

`runs/<run-id>/result.json` + `outputs.jsonl`. `compare`, `leaderboard` and CI read only these files.
A run folder is never replaced: run ids carry 32 random bits and a collision is detected when the
folder is moved into place (then the run gets a new id). Writers of one runs directory take its lock
(`runs_lock`), so concurrent sweeps queue instead of measuring the same baseline twice; reading
checks the schema and the types `compare` and `leaderboard` rely on.
"""

from __future__ import annotations

import errno
import hashlib
import json
import math
import os
import secrets
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from infer_tune import atomic
from infer_tune.document import SCHEMA_VERSION
from infer_tune.errors import ResultError

REQUIRED_KEYS = ("schema_version", "run_id", "created_at", "tool", "env", "model", "technique", "config",
                 "workload", "metrics", "samples")
DISTRIBUTION_METRICS = ("ttft_ms", "itl_ms", "tpot_ms", "e2e_ms")


def new_run_id(technique: str, label: str) -> str:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    slug = "".join(c if c.isalnum() or c in "-." else "-" for c in label.lower()).strip("-")[:40]
    return f"{stamp}-{technique}-{slug}-{secrets.token_hex(4)}" if slug else f"{stamp}-{technique}-{secrets.token_hex(4)}"


def fingerprint(*parts: Any) -> str:
    """Stable hash of what makes two runs the same measurement (used by --resume and baseline reuse)."""
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:16]


@dataclass
class SavedRun:
    run_dir: Path
    result: dict


def save_run(out_dir: Path, result: dict, outputs: list[dict], extra_files: dict[str, bytes] | None = None) -> SavedRun:
    """Write `out_dir/<run_id>/` atomically: a staged folder moved into place when complete, never over
    an existing run (on a collision the result gets a fresh run id, `result["run_id"]` is updated)."""
    for _ in range(8):
        final = Path(out_dir) / result["run_id"]
        try:
            with atomic.staged_dir(final, exists="error") as staging:
                atomic.write_json(staging / "result.json", result)
                atomic.write_text(staging / "outputs.jsonl",
                                  "".join(json.dumps(o, ensure_ascii=False) + "\n" for o in outputs))
                for name, data in (extra_files or {}).items():
                    atomic.write_bytes(staging / name, data)
        except FileExistsError:
            result["run_id"] = new_run_id(str(result.get("technique", "run")), str(result.get("label") or ""))
            continue
        return SavedRun(run_dir=final, result=result)
    raise OSError(errno.EEXIST, f"could not find a free run id in {out_dir}")


# --------------------------------------------------------------------------- the runs-directory lock
LOCK_NAME = ".infer-tune.lock"
_locks: dict[str, threading.RLock] = {}
_depth: dict[str, int] = {}
_fds: dict[str, int] = {}
_guard = threading.Lock()


def update_result(doc: dict) -> None:
    """Rewrite the `result.json` of a saved run (`doc["_path"]`) in place, atomically (a sweep adds a
    claim judged on all of its results); the run's other files stay as they are."""
    path = Path(doc["_path"]) / "result.json"
    atomic.write_json(path, {k: v for k, v in doc.items() if k != "_path"})


def add_files(doc: dict, files: dict[str, bytes]) -> None:
    """Write `files` into a saved run's folder (`doc["_path"]`), each atomically."""
    for name, data in files.items():
        atomic.write_bytes(Path(doc["_path"]) / name, data)


@contextmanager
def runs_lock(out_dir: str | Path, on_wait: Callable[[], None] | None = None) -> Iterator[None]:
    """Hold the exclusive lock of a runs directory (an flock on OUT/.infer-tune.lock, released by the
    kernel if the process dies). Re-entrant in one thread; other threads and processes wait, after
    `on_wait()` is called once. On taking it, staging leftovers of killed runs are removed."""
    import fcntl

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    key = os.path.realpath(out)
    with _guard:
        lock = _locks.setdefault(key, threading.RLock())
    if not lock.acquire(blocking=False):
        if on_wait:
            on_wait()
        lock.acquire()
    try:
        if _depth.get(key, 0) == 0:
            fd = os.open(out / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o666 & ~atomic.umask())
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                if on_wait:
                    on_wait()
                fcntl.flock(fd, fcntl.LOCK_EX)
            except BaseException:
                os.close(fd)
                raise
            _fds[key] = fd
            atomic.clean_stale(out)
        _depth[key] = _depth.get(key, 0) + 1
        try:
            yield
        finally:
            _depth[key] -= 1
            if _depth[key] == 0:
                fd = _fds.pop(key)
                fcntl.flock(fd, fcntl.LOCK_UN)
                os.close(fd)
    finally:
        lock.release()


# --------------------------------------------------------------------------- reading
def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _schema_problem(doc: dict) -> str | None:
    """What is wrong with a document's types (None when `compare` and `leaderboard` can read it)."""
    for key, kind in (("run_id", str), ("created_at", str), ("technique", str), ("tool", dict), ("env", dict),
                      ("model", dict), ("config", dict), ("workload", dict), ("metrics", dict), ("samples", dict)):
        if not isinstance(doc[key], kind):
            return f"'{key}' is {type(doc[key]).__name__}, expected {kind.__name__}"
    if not doc["run_id"] or "/" in doc["run_id"] or "\\" in doc["run_id"]:
        return f"'run_id' {doc['run_id']!r} is not a run id"
    for key, kind in (("label", str), ("protocol", dict), ("baseline_run_id", str), ("fingerprint", str),
                      ("runner", str)):
        if doc.get(key) is not None and not isinstance(doc[key], kind):
            return f"'{key}' is {type(doc[key]).__name__}, expected {kind.__name__}"
    for key in DISTRIBUTION_METRICS + ("queue_ms",):
        block = doc["metrics"].get(key)
        if block is None:
            continue
        if not isinstance(block, dict):
            return f"'metrics.{key}' is {type(block).__name__}, expected an object of statistics"
        for stat, value in block.items():
            if stat != "p50_ci95" and value is not None and not _number(value):
                return f"'metrics.{key}.{stat}' is {type(value).__name__}, expected a number"
    for key, values in doc["samples"].items():
        if values is None:
            continue
        if not isinstance(values, list):
            return f"'samples.{key}' is {type(values).__name__}, expected a list of numbers"
        if key == "prompt_index":
            if not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
                return "'samples.prompt_index' must hold integers"
        elif not all(_number(v) and math.isfinite(v) for v in values):
            return f"'samples.{key}' must hold finite numbers"
    return None


def load_result(path: str | Path) -> dict:
    """Read a result from a run folder or a result.json, checking schema version, required keys and
    the types that `compare` and `leaderboard` rely on (ResultError with one line otherwise)."""
    path = Path(path).expanduser()
    file = path / "result.json" if path.is_dir() else path
    if not file.is_file():
        raise ResultError(f"result not found: {path} (give a run folder or its result.json)")
    try:
        doc = json.loads(file.read_text(encoding="utf-8"))
    except PermissionError:
        raise ResultError(f"result file {file} is not readable (permission denied)") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        detail = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise ResultError(f"result file {file} is not valid JSON: {detail}") from None
    if not isinstance(doc, dict):
        raise ResultError(f"result file {file} does not hold a result object")
    version = doc.get("schema_version")
    if version != SCHEMA_VERSION or isinstance(version, bool):
        raise ResultError(f"result file {file} has schema_version {version!r}; this infer-tune reads {SCHEMA_VERSION}")
    missing = [k for k in REQUIRED_KEYS if k not in doc]
    if missing:
        raise ResultError(f"result file {file} lacks keys: {', '.join(missing)}")
    problem = _schema_problem(doc)
    if problem:
        raise ResultError(f"result file {file} is malformed: {problem}")
    doc.setdefault("_path", str(file.parent))
    return doc


def find_results(runs_dir: str | Path, skipped: list[tuple[str, str]] | None = None) -> list[dict]:
    """Every readable result under `runs_dir` (one level of run folders, or nested), oldest first.

    Unreadable ones are left out; pass a list as `skipped` to get (path, reason) for each of them.
    """
    root = Path(runs_dir).expanduser()
    if not root.exists():
        raise ResultError(f"runs directory not found: {runs_dir}")
    if not root.is_dir():
        raise ResultError(f"{runs_dir} is a file, not a runs directory")
    docs = []
    for file in sorted(root.rglob("result.json")):
        if any(part.startswith(".") for part in file.relative_to(root).parts):
            continue  # staging folders of runs still in progress
        try:
            docs.append(load_result(file))
        except ResultError as exc:
            if skipped is not None:
                skipped.append((str(file), str(exc)))
            continue
    return sorted(docs, key=lambda d: d.get("created_at", ""))


def load_outputs(run_dir: str | Path) -> list[dict]:
    """The outputs rows of a run (empty when it has none); ResultError when the file is corrupt."""
    file = Path(run_dir) / "outputs.jsonl"
    if not file.is_file():
        return []
    try:
        rows = [json.loads(line) for line in file.read_text(encoding="utf-8").splitlines() if line.strip()]
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ResultError(f"outputs file {file} is not valid JSON lines: {str(exc).splitlines()[0]}") from None
    if not all(isinstance(row, dict) for row in rows):
        raise ResultError(f"outputs file {file} holds rows that are not objects")
    return rows
