"""Result documents: one JSON record per (model, config, workload) run, written atomically.

`runs/<run-id>/result.json` + `outputs.jsonl`. `compare`, `leaderboard` and CI read only these files.
"""

from __future__ import annotations

import hashlib
import json
import secrets
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from infer_tune import atomic
from infer_tune.errors import ResultError

SCHEMA_VERSION = 1
REQUIRED_KEYS = ("schema_version", "run_id", "created_at", "tool", "env", "model", "technique", "config",
                 "workload", "metrics", "samples")
DISTRIBUTION_METRICS = ("ttft_ms", "itl_ms", "tpot_ms", "e2e_ms")


def new_run_id(technique: str, label: str) -> str:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    slug = "".join(c if c.isalnum() or c in "-." else "-" for c in label.lower()).strip("-")[:40]
    return f"{stamp}-{technique}-{slug}-{secrets.token_hex(2)}" if slug else f"{stamp}-{technique}-{secrets.token_hex(2)}"


def fingerprint(*parts: Any) -> str:
    """Stable hash of what makes two runs the same measurement (used by --resume and baseline reuse)."""
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:16]


@dataclass
class SavedRun:
    run_dir: Path
    result: dict


def save_run(out_dir: Path, result: dict, outputs: list[dict], extra_files: dict[str, bytes] | None = None) -> SavedRun:
    """Write `out_dir/<run_id>/` atomically: a staged folder renamed into place when complete."""
    final = Path(out_dir) / result["run_id"]
    with atomic.staged_dir(final) as staging:
        atomic.write_json(staging / "result.json", result)
        atomic.write_text(staging / "outputs.jsonl",
                          "".join(json.dumps(o, ensure_ascii=False) + "\n" for o in outputs))
        for name, data in (extra_files or {}).items():
            (staging / name).write_bytes(data)
    return SavedRun(run_dir=final, result=result)


def load_result(path: str | Path) -> dict:
    """Read a result from a run folder or a result.json, checking schema version and required keys."""
    path = Path(path)
    file = path / "result.json" if path.is_dir() else path
    if not file.is_file():
        raise ResultError(f"result not found: {path} (give a run folder or its result.json)")
    try:
        doc = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ResultError(f"result file {file} is not valid JSON: {exc}") from exc
    if not isinstance(doc, dict):
        raise ResultError(f"result file {file} does not hold a result object")
    version = doc.get("schema_version")
    if version != SCHEMA_VERSION:
        raise ResultError(f"result file {file} has schema_version {version!r}; this infer-tune reads {SCHEMA_VERSION}")
    missing = [k for k in REQUIRED_KEYS if k not in doc]
    if missing:
        raise ResultError(f"result file {file} lacks keys: {', '.join(missing)}")
    doc.setdefault("_path", str(file.parent))
    return doc


def find_results(runs_dir: str | Path) -> list[dict]:
    """Every readable result under `runs_dir` (one level of run folders, or nested), oldest first."""
    root = Path(runs_dir)
    if not root.exists():
        raise ResultError(f"runs directory not found: {runs_dir}")
    docs = []
    for file in sorted(root.rglob("result.json")):
        if any(part.startswith(".") for part in file.relative_to(root).parts):
            continue  # staging folders of runs still in progress
        try:
            docs.append(load_result(file))
        except ResultError:
            continue
    return sorted(docs, key=lambda d: d.get("created_at", ""))


def load_outputs(run_dir: str | Path) -> list[dict]:
    file = Path(run_dir) / "outputs.jsonl"
    if not file.is_file():
        return []
    return [json.loads(line) for line in file.read_text(encoding="utf-8").splitlines() if line.strip()]
