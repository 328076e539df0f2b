"""`compare`: deltas of candidate results against a base result, and the noise-aware CI gate.

A gate expression is `METRIC OP VALUE` (`OP` is one of `>`, `>=`, `<`, `<=`) and describes the
regression: the check fails when it holds.

- `VALUE` with `%` (`tpot_ms.p50 > +10%`) is a relative change of the candidate against the base,
  `100 * (cand / base - 1)`.
- `VALUE` without `%` (`bleu_drift < -1.0`) is compared with the candidate's own value; use it for
  metrics that already are deltas against a baseline (`bleu_drift`, `ppl_delta_pct`,
  `speedup_vs_baseline`) or for hard limits. When the candidate lacks one of those three delta
  metrics (a plain `bench` result), it is computed pairwise against the base instead.
- Timing distributions with raw samples (`ttft_ms`, `tpot_ms`, `e2e_ms`, `itl_ms`; statistic `p50`,
  `p90`, `p99` or `mean`, default `p50`) are judged by a 95% bootstrap interval, of the ratio
  stat(cand) / stat(base) for `%` thresholds and of stat(cand) for absolute ones. Each check has one
  of three outcomes (report/gate.py): regression when the WHOLE interval is past the threshold, pass
  when the whole interval is on the passing side, inconclusive when it straddles the threshold; the
  interval's half-width is printed as the smallest change this sample can detect.
  When both results timed the same prompts (same workload, and `samples.prompt_index` recorded),
  the median (`p50`) of `ttft_ms`, `tpot_ms` and `e2e_ms` is compared *paired*: per prompt the
  ratio of medians, their median as the estimate, and a two-level bootstrap (prompts, then each
  prompt's samples) for the interval. Pairing removes the prompt-to-prompt spread that makes an
  unpaired interval of a few requests wide. Two rows of the same interleaved rounds (one process,
  `metrics.rounds.group`) are compared on their per-round figures instead, one ratio per round
  (`rounds_ratio`), recomputed from each row's own samples; a rounds block its samples contradict is
  refused (exit 2: a row cannot borrow another row's rounds). Between separate runs every timing interval is widened by the run-to-run spread
  (report/run_to_run.py; docs/compare.md, "Run-to-run spread").
- Every other metric compares point values.

Base and candidates must be the same measurement but for the change under test: the same suite
and model (by content when recorded), max new tokens, batch size, limit, dtype, threads and machine.
Otherwise `compare` refuses (exit 2); `--allow-mismatch` turns that into a loud warning. Only when
BOTH results measured a live server (`runner: endpoint`) are model format, dtype, threads and machine
not compared (a deployment has its own); one side's `runner` alone never relaxes a check. Each
candidate says whether its timing medians were paired per prompt, and if not, why not.

What a result says about itself never loosens the gate: its noise figure can only withhold a pass
(inconclusive), failed requests above `max_failed_requests` make it a regression, and impossible
timings (negative durations, a zero TTFT or e2e) are refused as bad input (docs/compare.md).
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

import numpy as np

from infer_tune.document import ResultDocument, as_document
from infer_tune.errors import InferTuneError, ResultError
from infer_tune.metrics.stats import bootstrap_interval, pair_interval, paired_ratio_interval, ratio_interval
from infer_tune.report import gate
from infer_tune.report import run_to_run as rtr
from infer_tune.report.match import MATCH, SERVER_SIDE, MismatchError, check_match, mismatches  # noqa: F401
from infer_tune.results import DISTRIBUTION_METRICS

SAMPLE_STATS = ("p50", "p90", "p99", "mean")
POINT_STATS = ("p50", "p90", "p99", "mean", "stdev", "mad")
PAIRWISE_DELTAS = ("bleu_drift", "ppl_delta_pct", "speedup_vs_baseline")
MAIN_METRICS = ("ttft_ms.p50", "ttft_ms.p99", "tpot_ms.p50", "itl_ms.p50", "e2e_ms.p50", "output_throughput_tok_s",
                "peak_rss_bytes", "model_bytes", "bleu", "chrf", "ppl")
OPS = gate.OPS
_EXPR = re.compile(r"^\s*(?P<metric>[A-Za-z_][\w.]*)\s*(?P<op>>=|<=|>|<)\s*"
                   r"(?P<value>[+-]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d+)?)\s*(?P<pct>%)?\s*$")


class ExprError(InferTuneError):
    """A --fail-if expression that does not parse or names an unknown metric."""


@dataclass(frozen=True)
class Expr:
    """One parsed gate expression."""

    text: str
    metric: str
    op: str
    value: float
    relative: bool


def _location(doc: ResultDocument) -> str | None:
    """The folder a loaded result was read from (results.load_result); None for a document made in memory."""
    return str(doc.location) if doc.location is not None else None


def parse_expr(text: str) -> Expr:
    """Parse `METRIC OP VALUE[%]`, e.g. `tpot_ms.p50 > +10%` or `bleu_drift < -1.0`."""
    match = _EXPR.match(text or "")
    if not match:
        raise ExprError(f"cannot parse --fail-if {text!r}: expected METRIC OP VALUE with OP one of > >= < <=, "
                        "e.g. 'tpot_ms.p50 > +10%' or 'bleu_drift < -1.0'")
    metric = normalize_metric(match["metric"])
    return Expr(text=text.strip(), metric=metric, op=match["op"], value=float(match["value"]),
                relative=match["pct"] is not None)


def normalize_metric(name: str) -> str:
    """`tpot_ms` alone means its median, `tpot_ms.p50`."""
    return f"{name}.p50" if name in DISTRIBUTION_METRICS else name


def known_metrics(doc: ResultDocument) -> list[str]:
    """Every metric name a result document offers to `compare` (numeric leaves of `metrics`)."""
    names = []
    for key, value in doc.get("metrics", {}).items():
        if isinstance(value, dict):
            names += [f"{key}.{s}" for s in POINT_STATS if _is_number(value.get(s))]
        elif _is_number(value):
            names.append(key)
    return names


def metric_value(doc: ResultDocument, metric: str) -> float | None:
    """Point value of `metric` (`key` or `key.stat`) in a result document, None when absent or null."""
    key, _, stat = metric.partition(".")
    value = doc.get("metrics", {}).get(key)
    if stat:
        value = value.get(stat) if isinstance(value, dict) else None
    return float(value) if _is_number(value) else None


def pairwise_delta(base: ResultDocument, cand: ResultDocument, metric: str) -> float | None:
    """bleu_drift / ppl_delta_pct / speedup_vs_baseline of `cand` computed against `base` directly."""
    if metric == "bleu_drift":
        b, c = metric_value(base, "bleu"), metric_value(cand, "bleu")
        return None if b is None or c is None else c - b
    if metric == "ppl_delta_pct":
        b, c = metric_value(base, "ppl"), metric_value(cand, "ppl")
        return None if not b or c is None else 100.0 * (c - b) / b
    if metric == "speedup_vs_baseline":
        b, c = metric_value(base, "tpot_ms.p50"), metric_value(cand, "tpot_ms.p50")
        return None if not b or not c else b / c
    return None


def samples_of(doc: ResultDocument, metric: str) -> list[float] | None:
    """Raw samples behind a timing statistic, when the document kept them."""
    key, _, stat = metric.partition(".")
    if key not in DISTRIBUTION_METRICS or stat not in SAMPLE_STATS:
        return None
    values = [v for v in doc.get("samples", {}).get(key) or [] if _is_number(v)]
    return values or None


PAIRED_METRICS = ("ttft_ms", "tpot_ms", "e2e_ms")
WORKLOAD_KEYS = ("suite", "limit", "seed", "max_new_tokens", "batch_size", "chat_template", "lang", "prompts")


def paired_ratio(base: ResultDocument, cand: ResultDocument, metric: str, *, seed: int = 0) -> tuple[float, float, float] | None:
    """Paired bootstrap ratio of medians (see module docstring), or None when the runs are not paired."""
    key, _, stat = metric.partition(".")
    if key not in PAIRED_METRICS or stat != "p50":
        return None
    bw, cw = base.get("workload", {}), cand.get("workload", {})
    if any(bw.get(k) != cw.get(k) for k in WORKLOAD_KEYS):
        return None
    bs, cs = base.get("samples", {}), cand.get("samples", {})
    bi, ci = bs.get("prompt_index"), cs.get("prompt_index")
    bv, cv = bs.get(key), cs.get(key)
    if not bi or not ci or not bv or not cv or len(bi) != len(bv) or len(ci) != len(cv):
        return None
    return paired_ratio_interval(bv, bi, cv, ci, seed=seed)


# metric -> the figure a row measured in rounds keeps per round (metrics.rounds.per_round)
ROUND_FIGURES = {"tpot_ms.p50": "tpot_ms", "ttft_ms.p50": "ttft_ms", "e2e_ms.mean": "e2e_ms_mean",
                 "output_throughput_tok_s": "output_throughput_tok_s"}


ROUNDS_RTOL = 1e-6  # a per-round figure and the one recomputed from the row's samples agree to this (JSON floats)


def _round_chunks(values: object, rounds: int) -> list[list[float]] | None:
    """`values` (a row's per-request samples, every round's requests in round order: rounds.merged_run)
    cut into `rounds` equal parts, None when they cannot be."""
    if not isinstance(values, list) or rounds <= 0 or not values or len(values) % rounds:
        return None
    if not all(_is_number(v) for v in values):
        return None
    size = len(values) // rounds
    return [[float(v) for v in values[k * size:(k + 1) * size]] for k in range(rounds)]


def recomputed_rounds(doc: ResultDocument) -> dict[str, list[float | None]]:
    """The per-round figures of a row measured in rounds, recomputed from its own samples (what
    rounds.pass_value took from each pass): median TTFT / TPOT, mean e2e per round. A figure the samples
    cannot give back (TPOT when some request had a single token, so its samples do not split by round)
    is absent."""
    per_round = rtr.rounds_block(doc).get("per_round")
    samples = doc.get("samples") if isinstance(doc.get("samples"), dict) else {}
    if not isinstance(per_round, dict):
        return {}
    lengths = {len(v) for v in per_round.values() if isinstance(v, list)}
    if len(lengths) != 1:
        return {}
    rounds = lengths.pop()
    out: dict[str, list[float | None]] = {}
    requests = len(samples.get("ttft_ms") or [])
    for figure, key, how in (("ttft_ms", "ttft_ms", "median"), ("e2e_ms_mean", "e2e_ms", "mean"),
                             ("tpot_ms", "tpot_ms", "median")):
        values = samples.get(key)
        if key == "tpot_ms" and (not isinstance(values, list) or len(values) != requests):
            continue
        chunks = _round_chunks(values, rounds)
        if chunks is None:
            continue
        if how == "mean":
            out[figure] = [float(np.mean(c)) if c else None for c in chunks]
        else:
            kept = [[v for v in c if v > 0] for c in chunks]
            out[figure] = [float(np.median(c)) if c else None for c in kept]
    return out


def rounds_problem(doc: ResultDocument) -> str | None:
    """Why a row's `metrics.rounds.per_round` is not its own (a figure that its samples contradict: a copy
    of another row's rounds block), None when every figure its samples can give back agrees."""
    per_round = rtr.rounds_block(doc).get("per_round")
    if not per_round:
        return None
    if not isinstance(per_round, dict):
        return "'metrics.rounds.per_round' is not an object"
    for figure, values in per_round.items():
        if not isinstance(values, list) or not all(v is None or _is_number(v) for v in values):
            return f"'metrics.rounds.per_round.{str(figure)[:40]}' is not a list of finite numbers"
    for figure, mine in recomputed_rounds(doc).items():
        stated = per_round.get(figure)
        if not isinstance(stated, list):
            continue
        for k, (a, b) in enumerate(zip(stated, mine)):
            if (a is None) != (b is None) or (a is not None and not math.isclose(a, b, rel_tol=ROUNDS_RTOL)):
                return (f"metrics.rounds.per_round.{figure} gives round {k + 1} as {a:.6g} but the row's own "
                        f"samples give {b:.6g}: the rounds block does not match the row's samples"
                        if a is not None and b is not None else
                        f"metrics.rounds.per_round.{figure} round {k + 1} does not match the row's own samples")
    return None


def check_rounds(doc: ResultDocument) -> None:
    """Refuse (exit 2) a row whose rounds block its own samples contradict (`rounds_problem`)."""
    problem = rounds_problem(doc)
    if problem:
        raise ResultError(f"{doc.get('run_id', '?')}: {problem}")


def rounds_ratio(base: ResultDocument, cand: ResultDocument, metric: str) -> tuple[float, float, float, int] | None:
    """(estimate, low, high, rounds) of cand / base from their per-round figures, when both rows were
    measured in the same interleaved rounds: each round's pair ran back to back, so the rounds are the
    independent samples and the host's drift between rounds cancels (the engine's own interval).
    Only figures recomputed from each side's own samples are used (`recomputed_rounds`; `compare` has
    refused a rounds block that disagrees with them); throughput, which the samples do not give per
    round, is paired by rounds only when each row's rounds give back its own overall throughput."""
    figure = ROUND_FIGURES.get(metric)
    if figure is None or not rtr.same_rounds(base, cand):
        return None
    if figure == "output_throughput_tok_s":
        if not (_throughput_agrees(base) and _throughput_agrees(cand)):
            return None
        b, c = ((rtr.rounds_block(doc).get("per_round") or {}).get(figure) for doc in (base, cand))
    else:
        b, c = (recomputed_rounds(doc).get(figure) for doc in (base, cand))
    if not b or not c or len(b) != len(c):
        return None
    found = pair_interval(c, b)
    return None if found is None else (found["point"], *found["ci95"], found["rounds"])


def _throughput_agrees(doc: ResultDocument) -> bool:
    """Whether a row's per-round throughputs give back its overall throughput: each round's tokens
    (`samples.output_tokens`, split by round) over the round's wall time (tokens / its throughput), summed."""
    per_round = (rtr.rounds_block(doc).get("per_round") or {}).get("output_throughput_tok_s")
    overall = metric_value(doc, "output_throughput_tok_s")
    tokens = _round_chunks((doc.get("samples") or {}).get("output_tokens"), len(per_round or []))
    if not per_round or overall is None or tokens is None or any(not _is_number(v) or v <= 0 for v in per_round):
        return False
    wall = sum(sum(t) / v for t, v in zip(tokens, per_round))
    return wall > 0 and math.isclose(sum(map(sum, tokens)) / wall, overall, rel_tol=1e-3)


def pairing(base: ResultDocument, cand: ResultDocument) -> str:
    """Whether timing medians are compared per prompt (paired) and, if not, why not."""
    bw, cw = base.get("workload", {}), cand.get("workload", {})
    differ = [k for k in WORKLOAD_KEYS if bw.get(k) != cw.get(k)]
    if differ:
        return f"not paired: workloads differ in {', '.join(differ)}"
    bi, ci = base["samples"].get("prompt_index"), cand["samples"].get("prompt_index")
    if not bi or not ci:
        return "not paired: a result has no per-prompt samples (samples.prompt_index)"
    shared = len(set(bi) & set(ci))
    if shared < 2:
        return f"not paired: {shared} prompt(s) shared, 2 needed"
    return f"paired per prompt ({shared} prompts)"


def validate_exprs(exprs: Sequence[Expr], base: ResultDocument, candidates: Sequence[ResultDocument]) -> None:
    """Every expression must name a metric that the documents hold (exit 2 with the known list otherwise)."""
    known = set(known_metrics(base))
    for cand in candidates:
        known |= set(known_metrics(cand))
    known |= {m for m in PAIRWISE_DELTAS if any(pairwise_delta(base, c, m) is not None for c in candidates)}
    for expr in exprs:
        if expr.metric not in known:
            raise ExprError(f"unknown metric {expr.metric!r} in --fail-if {expr.text!r}; known: "
                            + ", ".join(sorted(known)))


@dataclass
class Delta:
    """One metric of one candidate against the base: values, relative change and its 95% interval."""

    metric: str
    base: float | None
    cand: float | None
    change_pct: float | None
    ci95_pct: list[float] | None = None
    method: str = "point"


@dataclass
class Check:
    """One gate expression judged on one candidate. `observed` is a change in % or a value.

    `outcome` is pass, regression or inconclusive (report/gate.py); `regressed` is outcome ==
    regression. `mde` is the interval's half-width (in % for a relative threshold, else the metric's
    unit): the smallest change this sample could detect; `mde_hint` says what would shrink it.
    """

    expr: str
    metric: str
    observed: float
    interval: list[float] | None
    threshold: float
    relative: bool
    method: str
    regressed: bool
    noise: str | None = None  # what a noisy input (metrics.noise) did to the verdict, if anything
    outcome: str = gate.PASS
    mde: float | None = None
    mde_hint: str | None = None
    reason: str | None = None  # why a check the gate adds itself (failed requests) came out as it did
    run_to_run_pct: float | None = None  # sd of the two runs' level difference added to the interval (separate runs), %


@dataclass
class CandidateReport:
    run_id: str
    path: str | None
    technique: str
    deltas: list[Delta] = field(default_factory=list)
    checks: list[Check] = field(default_factory=list)
    pairing: str = ""  # "paired per prompt (N prompts)" or "not paired: why"
    same_rounds: bool = False  # measured beside the base in one process's interleaved rounds: no run-to-run term

    @property
    def outcome(self) -> str:
        return gate.worst(c.outcome for c in self.checks)

    @property
    def regressed(self) -> bool:
        return self.outcome == gate.REGRESSION


@dataclass
class Comparison:
    """Everything `compare` found; `to_dict()` is its --json / --format json document."""

    base_run_id: str
    base_path: str | None
    exprs: list[str]
    candidates: list[CandidateReport]
    warnings: list[str] = field(default_factory=list)
    run_to_run: dict | None = None  # the spread added between separate runs and where it came from (rtr.Spread)

    @property
    def outcome(self) -> str:
        return gate.worst(c.outcome for c in self.candidates)

    @property
    def regressed(self) -> bool:
        return self.outcome == gate.REGRESSION

    def to_dict(self) -> dict:
        doc = asdict(self)
        for cand, rep in zip(doc["candidates"], self.candidates, strict=True):
            cand["outcome"], cand["regressed"] = rep.outcome, rep.regressed
        doc["outcome"], doc["regressed"] = self.outcome, self.regressed
        return doc


def delta(base: ResultDocument, cand: ResultDocument, metric: str, *, seed: int = 0, spread: rtr.Spread | None = None) -> Delta:
    """Relative change of `metric`, with a bootstrap interval when both sides kept raw samples, widened by
    the run-to-run spread (`spread`) when base and candidate are separate runs (report/run_to_run.py)."""
    found = _delta(base, cand, metric, seed=seed)
    sd = _pair_sd(spread, base, cand, metric)
    if sd and found.change_pct is not None:
        found.ci95_pct = rtr.widen(found.change_pct, found.ci95_pct, sd)
        found.method += " + run-to-run"
    return found


def _pair_sd(spread: rtr.Spread | None, base: ResultDocument, cand: ResultDocument, metric: str, *, relative: bool = True) -> float | None:
    """The run-to-run standard deviation (%) that applies to `metric` between `base` and `cand` (of their
    difference; of the candidate's level for an absolute threshold), None when none does."""
    if spread is None or rtr.same_rounds(base, cand):
        return None
    return (spread.pair_sd(metric, rtr.gap_s(base, cand)) if relative else spread.value_sd(metric)) or None


def _delta(base: ResultDocument, cand: ResultDocument, metric: str, *, seed: int = 0) -> Delta:
    b, c = metric_value(base, metric), metric_value(cand, metric)
    change = 100.0 * (c / b - 1.0) if b and c is not None else None
    by_round = rounds_ratio(base, cand, metric)
    if by_round is not None:
        point, low, high, n = by_round
        return Delta(metric, b, c, 100.0 * (point - 1.0), [100.0 * (low - 1.0), 100.0 * (high - 1.0)],
                     f"paired rounds ({n})")
    paired = paired_ratio(base, cand, metric, seed=seed)
    if paired is not None:
        point, low, high = paired
        return Delta(metric, b, c, 100.0 * (point - 1.0), [100.0 * (low - 1.0), 100.0 * (high - 1.0)],
                     "paired bootstrap")
    bs, cs = samples_of(base, metric), samples_of(cand, metric)
    if bs and cs:
        _, low, high = ratio_interval(bs, cs, stat=metric.partition(".")[2], seed=seed)
        return Delta(metric, b, c, change, [100.0 * (low - 1.0), 100.0 * (high - 1.0)], "bootstrap")
    return Delta(metric, b, c, change)


def judge(expr: Expr, base: ResultDocument, cand: ResultDocument, *, seed: int = 0, spread: rtr.Spread | None = None) -> Check:
    """Apply the gate rule (module docstring) of one expression to one candidate; `spread` widens a timing
    interval between separate runs (report/run_to_run.py)."""
    base, cand = as_document(base), as_document(cand)
    where = f"{expr.metric} of {cand.run_id}"
    stat = expr.metric.partition(".")[2]
    bs, cs = samples_of(base, expr.metric), samples_of(cand, expr.metric)
    by_round = rounds_ratio(base, cand, expr.metric) if expr.relative else None
    paired = paired_ratio(base, cand, expr.metric, seed=seed) if expr.relative and by_round is None else None
    if by_round is not None:
        point, low, high, n = by_round
        interval = [100.0 * (low - 1.0), 100.0 * (high - 1.0)]
        observed, method = 100.0 * (point - 1.0), f"paired rounds ({n})"
    elif paired is not None:
        point, low, high = paired
        interval = [100.0 * (low - 1.0), 100.0 * (high - 1.0)]
        observed, method = 100.0 * (point - 1.0), "paired bootstrap ratio"
    elif expr.relative:
        if bs and cs:
            point, low, high = ratio_interval(bs, cs, stat=stat, seed=seed)
            interval = [100.0 * (low - 1.0), 100.0 * (high - 1.0)]
            observed, method = 100.0 * (point - 1.0), "bootstrap ratio"
        else:
            b, c = metric_value(base, expr.metric), metric_value(cand, expr.metric)
            if b is None or c is None:
                raise ExprError(f"{where}: no value on {'the base' if b is None else 'the candidate'}")
            if b == 0:
                raise ExprError(f"{where}: the base value is 0, a % change is undefined; use an absolute threshold")
            observed, interval, method = 100.0 * (c - b) / abs(b), None, "point"
    elif cs:
        observed = float(np.mean(cs)) if stat == "mean" else float(np.percentile(cs, float(stat[1:])))
        interval, method = list(bootstrap_interval(cs, stat, seed=seed, resamples=2000)), "bootstrap value"
    else:
        value = metric_value(cand, expr.metric)
        method = "point"
        if value is None and expr.metric in PAIRWISE_DELTAS:
            value, method = pairwise_delta(base, cand, expr.metric), "pairwise vs base"
        if value is None:
            raise ExprError(f"{where}: the candidate has no value for it")
        observed, interval = value, None
    sd = _pair_sd(spread, base, cand, expr.metric, relative=expr.relative) if method != "pairwise vs base" else None
    if sd:
        interval = rtr.widen(observed, interval, sd) if expr.relative else rtr.widen_value(observed, interval, sd)
        method += " + run-to-run"
    result = gate.outcome(expr.op, expr.value, observed, interval)
    override, note = gate.noise_caution(expr.metric, expr.op, expr.value, expr.relative, observed, interval,
                                        base, cand)
    result = override or result
    mde, hint = gate.detectable(interval, expr.relative, observed, expr.value, cand,
                                decided=result != gate.INCONCLUSIVE)
    if sd:
        gap = rtr.gap_s(base, cand)
        apart = f"{gap / 60:.3g} min apart" if gap is not None else "apart"
        hint = (f"{hint}; of it, about ±{rtr.Z95 * sd:.2g}% is the run-to-run spread of two runs {apart} "
                f"(sd {sd:.2g}%, {spread.source}), which more samples do not shrink: measure base and "
                "candidate in one run's interleaved rounds (a recipe), or calibrate this machine "
                "(`infer-tune compare --calibrate RUN RUN RUN ...`)")
    return Check(expr=expr.text, metric=expr.metric, observed=observed, interval=interval, threshold=expr.value,
                 relative=expr.relative, method=method, regressed=result == gate.REGRESSION, noise=note,
                 outcome=result, mde=mde, mde_hint=hint, run_to_run_pct=sd)


def failed_requests_check(cand: ResultDocument, max_failed: int) -> Check | None:
    """The gate's own check on a candidate that records failed requests (endpoint runs): more than
    `max_failed` is a regression, whatever its latencies say (they describe only the requests that
    succeeded)."""
    failed = gate.failed_requests(cand)
    if failed is None:
        return None
    if failed < 0:
        raise ResultError(f"{cand['run_id']}: metrics.{'/'.join(gate.FAILURE_KEYS)} must be counts (non-negative integers)")
    kinds = cand.metrics.get("failures_by_kind")
    by_kind = ", ".join(f"{k} {v}" for k, v in kinds.items()) if isinstance(kinds, dict) and kinds else ""
    bad = failed > max_failed
    reason = (f"{failed} failed request(s){' (' + by_kind + ')' if by_kind else ''}, more than "
              f"--max-failed-requests {max_failed}: its timings describe only the requests that succeeded"
              if bad else f"{failed} failed request(s), within --max-failed-requests {max_failed}")
    return Check(expr=f"failed requests > {max_failed}", metric="requests_failed", observed=float(failed),
                 interval=None, threshold=float(max_failed), relative=False, method="count", regressed=bad,
                 outcome=gate.REGRESSION if bad else gate.PASS, reason=reason)


def check_timings(doc: ResultDocument) -> None:
    """Refuse (exit 2) a result whose timings are impossible: negative durations, a zero TTFT or e2e."""
    problem = gate.timing_problem(doc)
    if problem:
        raise ResultError(f"{doc.get('run_id', '?')}: impossible timings: {problem}")


def compare(base: ResultDocument, candidates: Sequence[ResultDocument], exprs: Sequence[Expr] = (), *, allow_mismatch: bool = False,
            seed: int = 0, max_failed_requests: int = 0, spread: rtr.Spread | None = None) -> Comparison:
    """Deltas of the main metrics and every gate expression, for each candidate against `base`, plus
    the gate's own failed-requests check on candidates that record failures (module docstring).
    `spread`: the run-to-run spread added between separate runs (default: this host's, rtr.for_host)."""
    base, candidates = as_document(base), [as_document(c) for c in candidates]
    spread = spread if spread is not None else rtr.for_host(base)
    for doc in (base, *candidates):
        check_timings(doc)
        check_rounds(doc)
    warnings = check_match(base, candidates, allow_mismatch=allow_mismatch)
    if (base_failed := gate.failed_requests(base)) == -1:
        raise ResultError(f"{base['run_id']}: metrics.{'/'.join(gate.FAILURE_KEYS)} must be counts (non-negative integers)")
    if base_failed and base_failed > 0:
        warnings.append(f"the base {base['run_id']} records {base_failed} failed request(s): its timings describe "
                        "only the requests that succeeded")
    validate_exprs(exprs, base, candidates)
    reports = []
    for cand in candidates:
        rep = CandidateReport(run_id=cand.run_id, path=_location(cand), technique=cand.technique or "?",
                              pairing=pairing(base, cand), same_rounds=rtr.same_rounds(base, cand))
        metrics = list(MAIN_METRICS) + [e.metric for e in exprs if e.metric not in MAIN_METRICS]
        rep.deltas = [delta(base, cand, m, seed=seed, spread=spread) for m in dict.fromkeys(metrics)
                      if metric_value(base, m) is not None or metric_value(cand, m) is not None]
        rep.checks = [judge(e, base, cand, seed=seed, spread=spread) for e in exprs]
        if (failed := failed_requests_check(cand, max_failed_requests)) is not None:
            rep.checks.append(failed)
        reports.append(rep)
    return Comparison(base_run_id=base.run_id, base_path=_location(base), exprs=[e.text for e in exprs],
                      candidates=reports, warnings=warnings, run_to_run=spread.to_dict())


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
