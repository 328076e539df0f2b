"""Run-to-run spread: how far a timing figure moves between separate processes that measure the same
thing on one host, beyond what each run's own samples show (docs/compare.md, "Run-to-run spread").

Two `bench` processes of the same config land a percent or two apart on a quiet host (memory layout,
thread placement, the host's own drift), while each run's bootstrap interval only covers the spread of
its own samples. `compare` therefore adds, in quadrature on the log scale, the spread of a difference
between two processes to the interval of a base and a candidate that were not measured in the same
interleaved rounds (`metrics.rounds.group`): without it an A/A pair of separate runs is a false alarm as
often as not. That spread has two parts: each run's own level (`sigma_pct`, from runs next to each other
in time) and the host's slow drift (`drift_pct`, what runs spread apart in time add), which counts in
proportion to the time between the two results (`created_at`) up to the calibration's span:
sd(difference)^2 = 2 sigma^2 + 2 drift^2 x min(1, gap / span).

`sigma_pct` (one process's level, in %, per metric) comes from, in this order: `--run-to-run PCT`; a
calibration of this host (`compare --calibrate RUN RUN RUN ...`: three or more results of one
measurement from separate processes; stored in $INFER_TUNE_HOME/run_to_run.json per machine and thread
count); else DEFAULT_SIGMA_PCT, measured on this project's 2-core hosts and said to be a default.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

import numpy as np

from infer_tune import atomic, paths
from infer_tune.document import ResultDocument, as_document
from infer_tune.errors import InferTuneError
from infer_tune.metrics.stats import bootstrap_interval
from infer_tune.report.match import hardware, mismatches

# the timing figures whose level moves between processes (a key, or a key of a distribution)
METRICS = ("ttft_ms", "tpot_ms", "e2e_ms", "itl_ms", "output_throughput_tok_s", "request_throughput_req_s")
# when the machine is not calibrated: a 2-core Xeon VM's calibration of `bench` over 27 runs in 46 minutes
# (TPOT p50: 1.74% per run from adjacent runs, 3.42% drift), rounded up (docs/compare.md)
DEFAULT_SIGMA_PCT = 2.0
DEFAULT_DRIFT_PCT = 3.5
DEFAULT_SPAN_S = 3600.0
MIN_RUNS = 3
FILE = "run_to_run.json"
Z95 = 1.96
Z95_ONE_SIDED = 1.645


def smallest_gate_pct(adjacent_pct: float) -> float:
    """The smallest `--fail-if` threshold (%) that two runs of one config, minutes apart on this host, pass
    19 times in 20: an A/A pair's change spreads with sd sqrt(2) x `adjacent_pct` (each run's level,
    its own samples included), and a pair passes when its 95% interval's top, about that change plus
    1.96 sd, is below the threshold; 95% of pairs stay below 1.645 sd. So (1.645 + 1.96) x sqrt(2) x
    `adjacent_pct`, taken on the log scale."""
    return 100.0 * math.expm1((Z95_ONE_SIDED + Z95) * math.sqrt(2.0) * adjacent_pct / 100.0)


@dataclass(frozen=True)
class Spread:
    """One process's run-to-run level spread (%, one standard deviation) per metric key, and its source."""

    sigma_pct: dict[str, float]
    source: str  # "option", "calibrated" or "default"
    detail: str
    drift_pct: dict[str, float] = field(default_factory=dict)  # the host's slow drift over `span_s`, per metric
    span_s: float | None = None  # how long the calibration's runs took, first to last

    def sigma(self, metric: str) -> float | None:
        key = metric.partition(".")[0]
        if key not in METRICS:
            return None
        return self.sigma_pct.get(key, self.sigma_pct.get("*"))

    def drift(self, metric: str, gap_s: float | None) -> float:
        """The drift that applies `gap_s` apart: all of it when the gap is unknown or past the span."""
        key = metric.partition(".")[0]
        full = self.drift_pct.get(key, self.drift_pct.get("*", 0.0))
        if not full:
            return 0.0
        share = 1.0 if gap_s is None or not self.span_s else min(1.0, gap_s / self.span_s)
        return full * math.sqrt(share)

    def pair_sd(self, metric: str, gap_s: float | None) -> float | None:
        """Standard deviation (%) of the difference of two runs' levels `gap_s` apart (module docstring)."""
        sigma = self.sigma(metric)
        if not sigma:
            return None
        return math.sqrt(2.0) * math.hypot(sigma, self.drift(metric, gap_s))

    def value_sd(self, metric: str) -> float | None:
        """Standard deviation (%) of one run's level against a fixed threshold: its own spread and the drift."""
        sigma = self.sigma(metric)
        return math.hypot(sigma, self.drift(metric, None)) if sigma else None

    def to_dict(self) -> dict:
        return asdict(self)


def host_key(doc: ResultDocument) -> str:
    """The machine (CPU, flags, cores, RAM, accelerator) and thread count a calibration belongs to."""
    identity = json.dumps([hardware(doc), (doc.get("env") or {}).get("threads")], sort_keys=True, default=str)
    return hashlib.sha256(identity.encode()).hexdigest()[:16]


def rounds_block(doc: ResultDocument) -> dict:
    """A result's `metrics.rounds` ({} for a row not measured in rounds): `ResultDocument.rounds`."""
    return as_document(doc).rounds


def same_rounds(base: ResultDocument, cand: ResultDocument) -> bool:
    """Whether both rows were measured in the same interleaved rounds (one process, alternating passes)."""
    group = rounds_block(base).get("group")
    return bool(group) and group == rounds_block(cand).get("group")


def for_host(base: ResultDocument, option_pct: float | None = None) -> Spread:
    """The spread `compare` uses for `base`'s host (module docstring: option, calibration, default)."""
    if option_pct == 0:
        return NONE
    if option_pct is not None:
        return Spread({"*": float(option_pct)}, "option", f"--run-to-run {option_pct:g}%")
    stored = _load().get(host_key(base))
    if stored:
        return Spread(dict(stored["sigma_pct"]), "calibrated",
                      f"calibrated on this machine from {stored['runs']} runs ({stored['created_at']})",
                      drift_pct=dict(stored.get("drift_pct") or {}), span_s=stored.get("span_s"))
    return Spread({"*": DEFAULT_SIGMA_PCT}, "default",
                  f"default {DEFAULT_SIGMA_PCT:g}% per run and {DEFAULT_DRIFT_PCT:g}% drift over "
                  f"{DEFAULT_SPAN_S / 60:g} min, not calibrated on this machine "
                  "(`infer-tune compare --calibrate RUN RUN RUN ...`)",
                  drift_pct={"*": DEFAULT_DRIFT_PCT}, span_s=DEFAULT_SPAN_S)


def _stamp(text: object) -> dt.datetime:
    """A result's `created_at` (`...T03:08:45.960+0000`, or any ISO form; Python 3.10 reads no `+0000`
    through fromisoformat)."""
    try:
        return dt.datetime.strptime(str(text), "%Y-%m-%dT%H:%M:%S.%f%z")
    except ValueError:
        return dt.datetime.fromisoformat(str(text))


def gap_s(base: ResultDocument, cand: ResultDocument) -> float | None:
    """Seconds between the two results' `created_at`, None when either lacks a readable one."""
    try:
        return abs((_stamp(cand.get("created_at")) - _stamp(base.get("created_at"))).total_seconds())
    except (ValueError, TypeError):  # unreadable, or one aware and one naive
        return None


FLOOR_PCT = -99.999  # the lowest % change the log scale takes (a value of 0 is held just above it)


def widen(observed: float, interval: list[float] | None, sd_pct: float) -> list[float]:
    """`interval` (in % change) widened by a run-to-run standard deviation `sd_pct` in quadrature on the
    log scale; a point value gets the run-to-run interval alone. A change of -100% (the candidate's value
    is 0, e.g. a latency below the clock's resolution) is held at -99.999% so the log scale stays defined."""
    spread = Z95 * sd_pct / 100.0
    low, high = interval if interval is not None else (observed, observed)
    observed, low, high = (max(v, FLOOR_PCT) for v in (observed, low, high))
    center = math.log1p(observed / 100.0)
    below = center - math.log1p(min(low, observed) / 100.0)
    above = math.log1p(max(high, observed) / 100.0) - center
    return [100.0 * math.expm1(center - math.hypot(below, spread)), 100.0 * math.expm1(center + math.hypot(above, spread))]


def widen_value(value: float, interval: list[float] | None, sd_pct: float) -> list[float]:
    """An absolute value's interval widened by one run's level spread `sd_pct` (the candidate alone)."""
    if value <= 0:
        return interval if interval is not None else [value, value]
    as_pct = None if interval is None else [100.0 * (v / value - 1.0) if v > 0 else FLOOR_PCT for v in interval]
    low, high = widen(0.0, as_pct, sd_pct)
    return [value * (1.0 + low / 100.0), value * (1.0 + high / 100.0)]


# --------------------------------------------------------------------------- calibration
@dataclass
class MetricSpread:
    metric: str
    runs: int
    between_pct: float  # standard deviation of the runs' log levels, %
    adjacent_pct: float  # the same from runs next to each other in time: sqrt(mean squared successive difference / 2), %
    drift_pct: float  # what the host's slow drift over the calibration adds: sqrt(between^2 - adjacent^2), at least 0
    within_pct: float  # the runs' own sampling error (root mean square of their bootstrap standard errors), %
    sigma_pct: float  # one run's level spread: sqrt(adjacent^2 - within^2), at least 0
    gate_pct: float = 0.0  # the smallest threshold two separate runs minutes apart pass 19 times in 20: smallest_gate_pct


@dataclass
class Calibration:
    host: str
    runs: int
    run_ids: list[str]
    span_s: float | None = None  # first run to last
    metrics: list[MetricSpread] = field(default_factory=list)
    created_at: str = ""
    path: str = ""

    @property
    def sigma_pct(self) -> dict[str, float]:
        return {m.metric: m.sigma_pct for m in self.metrics}

    @property
    def drift_pct(self) -> dict[str, float]:
        return {m.metric: m.drift_pct for m in self.metrics}

    def to_dict(self) -> dict:
        return asdict(self)


def _level(doc: ResultDocument, key: str) -> tuple[float, float] | None:
    """(log of the run's level, its standard error from its own samples) of a metric key."""
    metric = (doc.get("metrics") or {}).get(key)
    value = metric.get("p50") if isinstance(metric, dict) else metric
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not value or value <= 0:
        return None
    samples = [v for v in (doc.get("samples") or {}).get(key) or [] if isinstance(v, (int, float)) and v > 0]
    se = 0.0
    if isinstance(metric, dict) and len(samples) >= 2:
        low, high = bootstrap_interval(samples, "p50", seed=0, resamples=1000)
        if low > 0 and high > 0:
            se = (math.log(high) - math.log(low)) / (2 * Z95)
    return math.log(value), se


def calibrate(docs: Sequence[ResultDocument]) -> Calibration:
    """The run-to-run spread of `docs` (three or more results of one measurement, separate processes).

    The runs are taken in the order they were measured. One run's level spread comes from successive
    differences (runs next to each other in time), so a slow drift of the host across the calibration
    (minutes of other tenants, clocks) is reported beside it (`drift_pct`) instead of inflating it; the
    runs' own sampling error is taken out, since `compare` already has each run's interval."""
    docs = [as_document(d) for d in docs]
    if len(docs) < MIN_RUNS:
        raise InferTuneError(f"--calibrate needs at least {MIN_RUNS} results of the same measurement from separate "
                             f"runs; got {len(docs)}")
    first = docs[0]
    for doc in docs[1:]:
        found = mismatches(first, doc)
        if found:
            raise InferTuneError(f"--calibrate: {doc.get('run_id', '?')} was measured differently from "
                                 f"{first.get('run_id', '?')}: {'; '.join(found)}")
        if doc.get("fingerprint") != first.get("fingerprint") or doc.get("technique") != first.get("technique"):
            raise InferTuneError(f"--calibrate: {doc.get('run_id', '?')} is another config or workload than "
                                 f"{first.get('run_id', '?')} (fingerprints differ); calibrate on one measurement repeated")
    groups = {rounds_block(d).get("group") for d in docs}
    if None not in groups and len(groups) < len(docs):
        raise InferTuneError("--calibrate: some results come from the same rounds (one process); give one result per run")
    docs = sorted(docs, key=lambda d: (str(d.get("created_at", "")), str(d.get("run_id", ""))))
    cal = Calibration(host=host_key(first), runs=len(docs), run_ids=[d.get("run_id", "?") for d in docs],
                      span_s=gap_s(docs[0], docs[-1]))
    for key in METRICS:
        levels = [_level(d, key) for d in docs]
        if any(v is None for v in levels):
            continue
        logs = np.array([v[0] for v in levels])
        between = float(np.std(logs, ddof=1))
        adjacent = math.sqrt(float(np.mean(np.diff(logs) ** 2)) / 2.0)
        drift = math.sqrt(max(between ** 2 - adjacent ** 2, 0.0))
        within = math.sqrt(float(np.mean([v[1] ** 2 for v in levels])))
        sigma = math.sqrt(max(adjacent ** 2 - within ** 2, 0.0))
        cal.metrics.append(MetricSpread(key, len(docs), 100.0 * between, 100.0 * adjacent, 100.0 * drift,
                                        100.0 * within, 100.0 * sigma, smallest_gate_pct(100.0 * adjacent)))
    if not cal.metrics:
        raise InferTuneError("--calibrate: the results share no timing figure to calibrate")
    return cal


def save(cal: Calibration) -> Calibration:
    """Store `cal` for its host (replacing an earlier one) atomically; returns it with path and time set."""
    cal.created_at = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    path = paths.home() / FILE
    stored = _load()
    stored[cal.host] = {"sigma_pct": cal.sigma_pct, "drift_pct": cal.drift_pct, "span_s": cal.span_s,
                        "gate_pct": {m.metric: m.gate_pct for m in cal.metrics},
                        "runs": cal.runs, "run_ids": cal.run_ids, "created_at": cal.created_at}
    atomic.write_json(path, stored)
    cal.path = str(path)
    return cal


def _load() -> dict:
    path = paths.home() / FILE
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


NONE = Spread({}, "option", "none (--run-to-run 0)")  # adds nothing: same-process inputs, or tests of sampling alone
