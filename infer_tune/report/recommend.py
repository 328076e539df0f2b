"""The recommended configuration: the fastest result within a drift budget, decided from intervals, and
how to reproduce it.

Rows are ranked on the objective their technique is judged on (the document's `objective`, written
by the engine from the technique's registry entry: `decode` for single-stream techniques,
`throughput` for batching); `Budget.objective` "auto" takes the decode rows when there are any.
The winner is the row whose 95% interval of the objective has the highest lower bound; rows whose
interval overlaps the winner's are its contenders, and the recommendation says it is not separated
from them (measure more rounds to decide). A decode / TTFT winner must beat the baseline with its
whole interval. A noise flag never removes a row: a row's interval is its noise. Rows of random
weights (`model.weights: random`) have no quality figures: they are ranked on speed only, and the
recommendation says so.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from infer_tune.document import ResultDocument, as_document
from infer_tune.errors import InferTuneError
from infer_tune.report.display import is_broken

ENGINE = "engine"  # rows of a serving engine's launches (scenarios/engine_tune.py): not ranked here
OBJECTIVES = {"decode": "speedup_vs_baseline", "ttft": "ttft_speedup_vs_baseline",
              "throughput": "throughput_ratio_vs_baseline", "goodput": "goodput_ratio_vs_baseline"}
ENGINE_OBJECTIVES = ("decode", "ttft", "throughput")  # what an engine launch is tuned on (tune --engine)


@dataclass
class Budget:
    """What a recommendation may cost in quality (None: no limit on that signal)."""

    max_bleu_drift: float | None = 1.0  # points of BLEU lost at most
    max_ppl_delta: float | None = 5.0  # perplexity change in % at most
    require_lossless: bool = False  # token-identical to the baseline's outputs
    objective: str = "auto"  # decode / ttft / throughput / goodput, or auto: the rows' own objective (decode first)


@dataclass
class Recommendation:
    doc: ResultDocument | None
    reasons: list[str] = field(default_factory=list)  # why others were excluded (one per excluded run)
    command: str = ""
    saved_model: str | None = None
    objective: str = "decode"  # what the rows were ranked on
    interval: list[float] | None = None  # the winner's 95% interval of the objective (None: measured once)
    contenders: list[str] = field(default_factory=list)  # run ids whose interval overlaps the winner's
    separated: bool = True  # the winner's interval is clear of every other eligible row's
    speed_only: bool = False  # the rows ran random weights: no quality signal, ranked on speed alone

    SPEED_ONLY = "ranked on speed only: the rows ran random weights (quality is n/a)"

    def decision(self) -> str:
        """What the recommendation rests on, in one line: the objective, its interval, the contenders."""
        if self.doc is None:
            return ""
        value = self.doc.metric(OBJECTIVES[self.objective])
        what = {"decode": "decode speedup", "ttft": "TTFT speedup", "throughput": "output throughput",
                "goodput": "goodput"}[self.objective]
        shown = f"{value:.2f}x" if value is not None else "-"
        if self.interval:
            shown += f" [{self.interval[0]:.2f}, {self.interval[1]:.2f}] (95%)"
        else:
            shown += " (measured once, no interval)"
        if self.objective in ("throughput", "goodput"):
            shown += " of the baseline's"
        tail = ("separated from every other row" if self.separated else
                f"not separated from {len(self.contenders)} other row(s) whose interval overlaps: "
                "measure more rounds to decide")
        line = f"ranked on {what}: {shown}; {tail}"
        return f"{self.SPEED_ONLY}; {line}" if self.speed_only else line

    def to_dict(self) -> dict:
        return {"run_id": self.doc.run_id if self.doc else None, "command": self.command,
                "saved_model": self.saved_model, "excluded": self.reasons, "objective": self.objective,
                "interval": self.interval, "contenders": self.contenders, "separated": self.separated,
                "speed_only": self.speed_only}


def excluded_because(doc: ResultDocument, budget: Budget, objective: str = "decode") -> str | None:
    doc = as_document(doc)
    m = doc.metrics
    row = {**m, "technique": doc.technique}
    if is_broken(row):
        return f"broken: {m.get('broken_why') or 'perplexity more than doubled, or outputs unrelated to the baseline with quality dropping'}"
    ppl, drift = doc.ppl_delta_pct, doc.bleu_drift
    mismatches = m.get("output_mismatches_vs_baseline", m.get("output_mismatches"))
    if budget.require_lossless and mismatches != 0:
        return f"not lossless ({mismatches} outputs differ from the baseline's)"
    if budget.max_ppl_delta is not None and ppl is not None and ppl > budget.max_ppl_delta:
        return f"perplexity {ppl:+.2f}% over the {budget.max_ppl_delta:g}% budget"
    if budget.max_bleu_drift is not None and drift is not None and drift < -budget.max_bleu_drift:
        return f"BLEU drift {drift:+.2f} over the {budget.max_bleu_drift:g}-point budget"
    if doc.metric(OBJECTIVES[objective]) is None:
        return "no measured speedup against a baseline"
    return None


RECOMMENDED_FILE = "recommended.yaml"
RECOMMENDED_HEADER = "# infer-tune: the recommended configuration of this report; reproduce with"


def reproduce_command(doc: ResultDocument, recipe_path: Path | str = RECOMMENDED_FILE) -> str:
    """`infer-tune bench --recipe PATH`: the recipe `write_recommended` saved for `doc` (path shell-quoted)."""
    import shlex

    return f"infer-tune bench --recipe {shlex.quote(str(recipe_path))}"


def applicable_config(doc: ResultDocument) -> dict:
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
        stored = fields_of(config)
    return {"technique": technique, **stored}


def fields_of(config) -> dict:
    """A config's applicable fields that are set, as a recipe writes them; a stack's parts each as a recipe
    entry of its own (`technique` and its fields: no `kind`, which the recipe reader does not take)."""
    if hasattr(config, "parts") and config.technique == "stack":
        return {"configs": [{"technique": p.technique, **fields_of(p)} for p in config.parts()]}
    return {k: getattr(config, k) for k in config.applicable_fields() if getattr(config, k) is not None}


def recommended_recipe(doc: ResultDocument) -> dict:
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


def interval_of(doc: ResultDocument, objective: str) -> tuple[float, float, float] | None:
    """(low, point, high) of a row's objective; a row measured once has low == point == high."""
    key, doc = OBJECTIVES[objective], as_document(doc)
    point = doc.metric(key)
    if point is None:
        return None
    ci = doc.interval(key)
    return (ci[0], point, ci[1]) if ci else (point, point, point)


def row_objective(doc: ResultDocument) -> str:
    value = doc.get("objective")
    return value if value in OBJECTIVES else "decode"


def recommend(docs: list[ResultDocument], budget: Budget) -> Recommendation:
    """The candidate whose objective interval has the highest lower bound among those within the budget
    (baselines excluded), with its contenders (module docstring)."""
    docs = [as_document(d) for d in docs]
    candidates = [d for d in docs if d.technique not in ("baseline", None, ENGINE) and d.baseline_run_id]
    launches = sum(1 for d in docs if d.technique == ENGINE and d.baseline_run_id)
    objective = budget.objective
    if objective == "auto":
        kinds = {row_objective(d) for d in candidates}
        objective = "decode" if "decode" in kinds or not kinds else sorted(kinds)[0]
    eligible, reasons = [], []
    for doc in candidates:
        if budget.objective == "auto" and row_objective(doc) != objective:
            continue  # ranked with the rows of its own objective, not against single-stream decode
        why = excluded_because(doc, budget, objective)
        if why:
            reasons.append(f"{doc.technique} {doc.label or ''}: {why}".strip())
        else:
            eligible.append(doc)
    if launches:  # their ratios are against their engine's default launch, not this report's baseline
        reasons.append(f"{launches} engine launch row(s) left to tune --engine, which ranks them against the "
                       "engine's default launch (its recommended.yaml)")
    speed_only = any(random_weights(d) for d in candidates)
    if speed_only:  # no quality figure exists to hold against a budget (docs/metrics.md, "Random weights")
        reasons.insert(0, Recommendation.SPEED_ONLY)
    if not eligible:
        return Recommendation(doc=None, reasons=reasons, objective=objective, speed_only=speed_only)
    best = max(eligible, key=lambda d: interval_of(d, objective))
    low, point, high = interval_of(best, objective)
    contenders = [d.run_id for d in eligible if d is not best and interval_of(d, objective)[2] >= low]
    interval = [low, high] if low != high else None
    if objective != "throughput" and low <= 1.0:
        shown = f"{point:.2f}x [{low:.2f}, {high:.2f}]" if interval else f"{point:.2f}x"
        reasons.append(f"no configuration within the budget beat the baseline with its whole interval on this "
                       f"device (best: {best.label} {shown})")
        return Recommendation(doc=None, reasons=reasons, objective=objective, contenders=contenders,
                              speed_only=speed_only)
    saved = best.metrics.get("save_dir")  # a technique that saved what it built (quantized weights)
    if saved and not Path(saved).is_dir():  # a temporary save, deleted when its run ended
        saved = None
    return Recommendation(doc=best, reasons=reasons, command=reproduce_command(best), saved_model=saved,
                          objective=objective, interval=interval, contenders=contenders, separated=not contenders,
                          speed_only=speed_only)


def random_weights(doc: ResultDocument) -> bool:
    """The row ran a model built with random weights (`model.weights`)."""
    return (doc.get("model") or {}).get("weights") == "random"
