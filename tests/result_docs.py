"""Synthetic, valid schema_version 1 result documents with raw samples (no model, no timing)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from infer_tune.metrics.stats import summarize
from infer_tune.results import SCHEMA_VERSION


def make_result(run_id: str = "base", *, technique: str = "baseline", tpot_ms: float = 40.0, ttft_ms: float = 200.0,
                n: int = 60, noise: float = 0.02, seed: int = 0, suite: str = "chat", model: str = "smollm2-135m",
                config: dict | None = None, **metrics) -> dict:
    """A result whose timing samples are centred on `tpot_ms` / `ttft_ms` with relative `noise`."""
    rng = np.random.default_rng(seed)
    samples = {
        "tpot_ms": list(tpot_ms * (1 + noise * rng.standard_normal(n))),
        "ttft_ms": list(ttft_ms * (1 + noise * rng.standard_normal(n))),
        "itl_ms": list(tpot_ms * (1 + noise * rng.standard_normal(4 * n))),
    }
    samples["e2e_ms"] = [t + 31 * p for t, p in zip(samples["ttft_ms"], samples["tpot_ms"], strict=True)]
    body = {key: summarize(values, resamples=200) for key, values in samples.items()}
    body.update({"output_throughput_tok_s": 1000.0 / tpot_ms, "peak_rss_bytes": 10**9, "model_bytes": 5 * 10**8,
                 "bleu": 10.0, "chrf": 30.0, "ppl": 5.0, "roofline_fraction": 0.3})
    body.update(metrics)
    return {
        "schema_version": SCHEMA_VERSION, "run_id": run_id, "created_at": f"2026-01-01T00:00:{seed % 60:02d}",
        "tool": {"name": "infer-tune", "version": "0.1.0"}, "env": {"threads": 2},
        "model": {"ref": model}, "technique": technique, "config": config or {},
        "workload": {"suite": suite, "limit": 4, "max_new_tokens": 32, "prompts": 4},
        "metrics": body, "samples": samples,
    }


def save(doc: dict, runs_dir: Path) -> Path:
    """Write `runs_dir/<run_id>/result.json` and return the run folder."""
    folder = Path(runs_dir) / doc["run_id"]
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "result.json").write_text(json.dumps(doc))
    return folder
