"""The recommended configuration: the fastest result within a drift budget, and how to reproduce it."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

from infer_tune.errors import InferTuneError
from infer_tune.report.display import is_broken

OBJECTIVES = {"decode": "speedup_vs_baseline", "ttft": "ttft_speedup_vs_baseline",
              "throughput": "throughput_ratio_vs_baseline"}


@dataclass
class Budget:
    """What a recommendation may cost in quality (None: no limit on that signal)."""

    max_bleu_drift: float | None = 1.0  # points of BLEU lost at most
    max_ppl_delta: float | None = 5.0  # perplexity change in % at most
    require_lossless: bool = False  # token-identical to the baseline's outputs
    objective: str = "decode"


@dataclass
class Recommendation:
    doc: dict | None
    reasons: list[str] = field(default_factory=list)  # why others were excluded (one per excluded run)
    command: str = ""
    saved_model: str | None = None

    def to_dict(self) -> dict:
        return {"run_id": self.doc["run_id"] if self.doc else None, "command": self.command,
                "saved_model": self.saved_model, "excluded": self.reasons}


def _num(v) -> float | None:
    return None if v is None or (isinstance(v, float) and math.isnan(v)) else float(v)


def excluded_because(doc: dict, budget: Budget) -> str | None:
    m = doc.get("metrics") or {}
    row = {**m, "technique": doc.get("technique")}
    if is_broken(row):
        return "broken (perplexity more than doubled or outputs unrelated to the baseline's)"
    ppl, drift, mismatches = _num(m.get("ppl_delta_pct")), _num(m.get("bleu_drift")), m.get("output_mismatches")
    if budget.require_lossless and mismatches != 0:
        return f"not lossless ({mismatches} outputs differ from the baseline's)"
    if budget.max_ppl_delta is not None and ppl is not None and ppl > budget.max_ppl_delta:
        return f"perplexity {ppl:+.2f}% over the {budget.max_ppl_delta:g}% budget"
    if budget.max_bleu_drift is not None and drift is not None and drift < -budget.max_bleu_drift:
        return f"BLEU drift {drift:+.2f} over the {budget.max_bleu_drift:g}-point budget"
    if (m.get("noise") or {}).get("noisy"):
        return "timing flagged noisy (the machine was not idle while it ran): measure again before choosing"
    if _num(m.get(OBJECTIVES[budget.objective])) is None:
        return "no measured speedup against a baseline"
    return None


RECOMMENDED_FILE = "recommended.yaml"
RECOMMENDED_HEADER = "# infer-tune: the recommended configuration of this report; reproduce with"


def reproduce_command(doc: dict, recipe_path: Path | str = RECOMMENDED_FILE) -> str:
    """`infer-tune bench --recipe PATH`: the recipe `write_recommended` saved for `doc` (path shell-quoted)."""
    import shlex

    return f"infer-tune bench --recipe {shlex.quote(str(recipe_path))}"


def applicable_config(doc: dict) -> dict:
    """The row's config as a recipe entry: its technique and only the fields that apply to its method
    (the config class says which: `applicable_fields`); the stored values when the class cannot be built."""
    import dataclasses

    stored = {k: v for k, v in (doc.get("config") or {}).items() if k != "kind" and v is not None}
    technique = doc.get("technique")
    try:
        from infer_tune.tuners.base import configs_by_technique

        cls = configs_by_technique().get(technique)
        names = {f.name for f in dataclasses.fields(cls)} if cls else set()
        config = cls(**{k: v for k, v in stored.items() if k in names}) if cls else None
    except (InferTuneError, TypeError, ValueError):  # a malformed stored config: keep what was stored
        config = None
    if config is not None:
        stored = {k: getattr(config, k) for k in config.applicable_fields() if getattr(config, k) is not None}
    return {"technique": technique, **stored}


def recommended_recipe(doc: dict) -> dict:
    """A one-config recipe measuring `doc`'s config again on its model, workload and protocol."""
    import dataclasses

    from infer_tune.workload import Protocol, Workload

    def known(block, cls) -> dict:
        names = {f.name for f in dataclasses.fields(cls)}
        return {k: v for k, v in (block or {}).items() if k in names and v is not None}

    recipe = {"description": f"recommended: {doc.get('technique')} {doc.get('label') or ''}".strip(),
              "model": (doc.get("model") or {}).get("ref"), "workload": known(doc.get("workload"), Workload),
              "protocol": known(doc.get("protocol"), Protocol), "configs": [applicable_config(doc)]}
    return {k: v for k, v in recipe.items() if v not in (None, {}, "")}


def write_recommended(rec: Recommendation, out_dir: Path | str) -> Path | None:
    """Save `OUT/recommended.yaml` for the recommendation (and point its command at it); with no
    recommendation, remove one this writer left there earlier. Returns the file written, or None."""
    import yaml

    from infer_tune import atomic

    path = Path(out_dir) / RECOMMENDED_FILE
    if rec.doc is None:
        if path.is_file() and not path.is_symlink() and path.read_text(errors="replace").startswith(RECOMMENDED_HEADER):
            path.unlink()
        return None
    rec.command = reproduce_command(rec.doc, path)
    body = yaml.safe_dump(recommended_recipe(rec.doc), sort_keys=False, allow_unicode=False, width=100)
    atomic.write_text(path, f"{RECOMMENDED_HEADER}\n#   {' '.join(rec.command.split())}\n{body}")
    return path


def recommend(docs: list[dict], budget: Budget) -> Recommendation:
    """The candidate with the best objective among those within the budget (baselines excluded)."""
    key = OBJECTIVES[budget.objective]
    eligible, reasons = [], []
    for doc in docs:
        if doc.get("technique") in ("baseline", None) or doc.get("baseline_run_id") is None:
            continue
        why = excluded_because(doc, budget)
        if why:
            reasons.append(f"{doc.get('technique')} {doc.get('label', '')}: {why}".strip())
        else:
            eligible.append(doc)
    if not eligible:
        return Recommendation(doc=None, reasons=reasons)
    best = max(eligible, key=lambda d: _num(d["metrics"].get(key)) or 0.0)
    if (_num(best["metrics"].get(key)) or 0.0) <= 1.0:
        reasons.append("no configuration within the budget beat the baseline on this device")
        return Recommendation(doc=None, reasons=reasons)
    saved = best["metrics"].get("save_dir") if best.get("technique") == "quantize" else None
    if saved and not Path(saved).is_dir():  # a temporary save, deleted when its run ended
        saved = None
    return Recommendation(doc=best, reasons=reasons, command=reproduce_command(best), saved_model=saved)
