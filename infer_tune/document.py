"""The result document's typed home: what every `result.json` holds, built in one place (the sweep
engine's `sweep.build_document`, or a row `sweep.save_rows` writes), kept as a `ResultDocument` until
it is written, and read back as one by `results.load_result`, which validates it first. Where a saved
result lives (`location`) is not part of its data: it is never written into `result.json`. The keys and
their meaning: docs/architecture.md, "Result documents".
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from infer_tune.metrics.schema import NAMESPACE_SWEEP, Metrics, check_declared
from infer_tune.metrics.schema import finite as finite  # re-exported: readers import it from here

SCHEMA_VERSION = 1


@dataclass
class RoundsBlock:
    """`metrics.rounds` of a row measured in interleaved rounds (docs/architecture.md, "The sweep engine")."""

    rounds: int
    elapsed_s: float
    variants: int
    target_half_width_pct: float
    achieved_half_width_pct: float | None
    target_met: bool | None  # None for the baseline (it has no ratio of its own)
    stopped_by: str  # "target", "max_rounds", "max_duration_s" or "early: <why>" (rounds.run_rounds' `stop`)
    baseline_drift_pct: float | None
    design: str = "interleaved"
    # this variant's pass figures, one per round (rounds.PER_ROUND): two rows of the same rounds pair up
    per_round: dict[str, list[float | None]] | None = None
    other_cpu_by_round: list[float] | None = None  # share of the host's CPU other processes used, per round
    major_faults_by_round: list[int] | None = None  # pages the process had to read back (paged out), per round
    # one id per rounds run: rows with the same group were measured in the same process, interleaved, so
    # `compare` adds no run-to-run spread between them (docs/compare.md, "Run-to-run spread")
    group: str | None = None
    # the ratios the target was on (rounds.judged): achieved_half_width_pct is the widest of their intervals
    judged_on: list[str] | None = None
    # request batches run again per round because other processes used the host meanwhile (rounds.RERUNS)
    reruns_by_round: list[int] | None = None
    # how each ratio's interval was taken (metrics.stats.paired_rounds_interval): name -> {pooled, df,
    # rounds_f_p}; pooled: the rounds did not differ beyond the pairs, which were the samples
    interval_method: dict[str, dict] | None = None
    # per round, the mean of the plain reads of this variant's weights taken right after each of its runs
    # (env.read_gb_s), GB/s: the ceiling its `roofline_tok_s` takes (their median), from the seconds of its decode
    read_gb_s_by_round: list[float | None] | None = None
    # per round, each prompt's TPOT ({prompt index: ms}): a ratio between any two rows of the group taken as the
    # rows' own are (rounds.round_ratio; the stack thesis, tuners/stack/thesis.py)
    tpot_ms_by_prompt_by_round: list[dict[str, float]] | None = None


# top-level sections a sweep hook adds over every row of a technique (not measured: set, or set again)
SECTIONS = ("sweep", "serve_summary", "claims", "not_applicable")
# what ran the row (docs/architecture.md, "The engine axis"): written together whenever `engine` is set (every
# row measured now); a document of an earlier version has none of them
ENGINE_KEYS = ("engine", "engine_version", "engine_argv")


class OverwriteError(ValueError):
    """A technique's fact would replace a measured key of the result with a different value."""


class FrozenResultError(TypeError):
    """A saved result (one with a `location`) would be changed: a saved result is never modified."""


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 (arrays and the like: not equal as a bool)
        return a is b


def check_overwrite(metrics: Mapping[str, Any], facts: Mapping[str, Any], source: str) -> None:
    """OverwriteError naming `source` and the keys of `facts` already in `metrics` with a different value:
    technique facts never replace measured figures silently. A key that is there as null was not measured
    (a perplexity the engine did not take, say): a fact may fill it."""
    clash = [k for k, v in facts.items() if metrics.get(k) is not None and not _same(metrics[k], v)]
    if clash:
        raise OverwriteError(f"{source} would overwrite measured metrics: {', '.join(sorted(clash))} "
                             f"({', '.join(f'{k}: {metrics[k]!r} -> {facts[k]!r}' for k in sorted(clash)[:3])})")


def merge_facts(metrics: dict[str, Any], facts: Mapping[str, Any], source: str) -> None:
    """`facts` added to a plain `metrics` dict being built (sweep.build_document), refused where they would
    replace a measured figure (`check_overwrite`)."""
    check_overwrite(metrics, facts, source)
    metrics.update(facts)


def row_namespaces(technique: str | None, config: Mapping[str, Any] | None, engine: str | None) -> list[str]:
    """The namespaces a row's own facts may come from (metrics/schema.py): its technique (each part of a
    stack) and its engine."""
    spaces = [technique] if technique else []
    if technique == "stack":
        spaces += [p.get("technique") for p in (config or {}).get("configs") or [] if isinstance(p, Mapping)
                   and isinstance(p.get("technique"), str)]
    return spaces + ([f"engine:{engine}"] if engine else [])


@dataclass(eq=False)
class ResultDocument(Mapping):
    """One measured (or predicted) run: where and what was measured, its metrics and raw samples.

    `metrics` holds the shared timing / quality / memory figures (sweep.build_document), the deltas
    against the baseline (metrics/deltas.py), the technique's own keys (its `prepare` facts, run-time
    counters and `finish`, added through `add_metrics`, which refuses to replace a measured figure), and
    `rounds` / `noise`. `objective` is what a candidate row is ranked on. A row is (model, technique stack,
    engine, workload): `engine` names the registered engine that ran it (engines/base.py ENGINES: torch,
    lean, slots, llama.cpp, vllm, sglang, remote...), `engine_version` what identifies its build
    (`Engine.identity()`: versions, a commit; {} when unknown) and `engine_argv` the command line of an
    engine launched as a server (None for one in this process or not started by infer-tune). The sweep-level sections
    (`sweep`, `serve_summary`, `claims`, `not_applicable`) are set with `set_section`. Top-level keys this
    version does not name (written by another) are kept in `extra` and written back as they were.

    It reads as a mapping of its JSON keys (`doc.metrics`, `doc.get("objective")`), so readers take a
    loaded document and a hand-made dict alike; it has no item assignment, and its `metrics` are a read-only
    `Metrics` (metrics/schema.py): what changes after it is built goes through its methods, and a key a
    technique, an engine or the sweep adds must be declared by its namespace. `location` is the folder it was
    saved in or read from (None before it is saved), never written. Once saved (or read back) it is frozen:
    a change raises FrozenResultError. What a sweep concludes over its rows after they were saved (a claim
    over all of them, the knee) is a separate conclusion (`conclusion`, saved beside result.json by
    results.save_conclusion), read back merged into a new document (`with_conclusion`).
    """

    run_id: str
    created_at: str
    tool: dict[str, Any]
    env: dict[str, Any]
    model: dict[str, Any]
    technique: str
    label: str | None
    config: dict[str, Any]
    runner: str | None
    workload: dict[str, Any]
    protocol: dict[str, Any] | None
    metrics: Metrics
    samples: dict[str, list]
    fingerprint: str | None
    baseline_run_id: str | None = None
    objective: str | None = None
    engine: str | None = None
    engine_version: dict[str, Any] | None = None
    engine_argv: list[str] | None = None
    schema_version: int = SCHEMA_VERSION
    sweep: dict[str, Any] | None = None  # batch sweep: throughput by size and the knee (tuners/batch `conclude`)
    serve_summary: dict[str, Any] | None = None  # batch serve-sim: the table over rates (scenarios/batch.py)
    claims: list[dict] | None = None  # kv-cache: the claims of one context length (scenarios/kv_cache.py)
    not_applicable: list[dict] | None = None  # kv-cache: the variants that could not run at that length
    extra: dict[str, Any] = field(default_factory=dict)
    location: Path | None = field(default=None, repr=False)
    # what a sweep concluded over this row after it was saved ({"metrics": {...}, "sections": {...}}), merged
    # into the fields above; saved beside result.json, never in it (results.save_conclusion)
    conclusion: dict[str, Any] | None = field(default=None, repr=False)

    # ----------------------------------------------------------------- frozen once saved
    def __setattr__(self, name: str, value: Any) -> None:
        if self.__dict__.get("_frozen"):
            raise FrozenResultError(f"result {self.__dict__.get('run_id')!r} is saved ({self.location}): it is never "
                                    f"modified (its '{name}' cannot be set)")
        if name == "metrics" and not isinstance(value, Metrics):
            value = Metrics(value or {})
        object.__setattr__(self, name, value)

    @property
    def frozen(self) -> bool:
        return bool(self.__dict__.get("_frozen"))

    def freeze(self) -> None:
        """No change from now on (results.save_run calls it once the result is saved; load_result on reading)."""
        object.__setattr__(self, "_frozen", True)

    def _changing(self, what: str) -> None:
        if self.frozen:
            raise FrozenResultError(f"result {self.run_id!r} is saved ({self.location}): it is never modified "
                                    f"({what} refused; a sweep's conclusion is saved beside it: with_conclusion)")

    # ----------------------------------------------------------------- the JSON keys, as a mapping
    def _keys(self) -> list[str]:
        names = [f.name for f in fields(self) if f.name not in NOT_DATA]
        optional = ("objective",) + SECTIONS
        engine = self.engine is not None
        return [n for n in names if (n not in optional or getattr(self, n) is not None)
                and (n not in ENGINE_KEYS or engine)] + list(self.extra)

    def __getitem__(self, key: str) -> Any:
        if key in self.extra:
            return self.extra[key]
        if key in NOT_DATA or key not in self.__dataclass_fields__:
            raise KeyError(key)
        value = getattr(self, key)
        if value is None and key in ("objective",) + SECTIONS or key in ENGINE_KEYS and self.engine is None:
            raise KeyError(key)
        return value

    def __iter__(self) -> Iterator[str]:
        return iter(self._keys())

    def __len__(self) -> int:
        return len(self._keys())

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Mapping):
            return self.to_dict() == dict(other)
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]

    # ----------------------------------------------------------------- typed changes after the build
    def set_engine(self, name: str, version: Mapping[str, Any] | None = None, argv: list[str] | None = None) -> None:
        """What ran the row: the registered engine's name, its version facts and its launch argv (set where
        the row is made: sweep.build_document, an endpoint or launch row)."""
        self._changing("set_engine")
        self.engine = name
        self.engine_version = dict(version or {})
        self.engine_argv = [str(a) for a in argv] if argv is not None else None

    def add_metrics(self, facts: Mapping[str, Any] | None, *, source: str, namespace: str | None = None) -> None:
        """Facts added under `metrics` before the row is saved (a technique's `finish`, an admission, an
        engine's figures). Each key is a core figure or declared by the namespace it comes from
        (UndeclaredMetricError naming `source` and the key): `namespace` None is the row's own (its
        technique, each part of a stack, and its engine), `sweep` the sweep's (schema.SWEEP_KEYS). A key
        already measured with a different value is refused (OverwriteError)."""
        self._changing(f"add_metrics from {source}")
        facts = facts or {}
        spaces = [namespace] if namespace else row_namespaces(self.technique, self.config, self.engine)
        check_declared(facts, spaces, source)
        check_overwrite(self.metrics, facts, source)
        self.metrics._merge(facts)

    def set_sweep_metrics(self, facts: Mapping[str, Any], *, source: str = "the sweep") -> None:
        """Keys of the sweep's namespace (schema.SWEEP_KEYS: over every row of a sweep; or the row's own
        namespaces, a technique's `conclude`) set on a row not yet saved: set, or set again. Once the row is saved they go in its conclusion (`with_conclusion`)."""
        self._changing(f"set_sweep_metrics from {source}")
        check_declared(facts, [NAMESPACE_SWEEP, *row_namespaces(self.technique, self.config, self.engine)], source)
        self.metrics._merge(facts)

    def add_workload(self, facts: Mapping[str, Any], *, source: str) -> None:
        """Facts about what was run added to `workload` before the row is saved (a sweep's prompt source); a
        key already there with a different value is refused."""
        self._changing(f"add_workload from {source}")
        clash = [k for k, v in facts.items() if self.workload.get(k) is not None and not _same(self.workload[k], v)]
        if clash:
            raise OverwriteError(f"{source} would overwrite the workload's {', '.join(sorted(clash))}")
        self.workload.update(facts)

    def set_section(self, name: str, value: Any) -> None:
        """A sweep-level section (`SECTIONS`), computed over every row of the sweep, on a row not yet saved:
        set, or set again (a saved row gets it in its conclusion: `with_conclusion`)."""
        self._changing(f"set_section {name}")
        if name not in SECTIONS:
            raise KeyError(f"'{name}' is not a section of a result document ({', '.join(SECTIONS)})")
        setattr(self, name, value)

    def with_conclusion(self, metrics: Mapping[str, Any] | None = None,
                        sections: Mapping[str, Any] | None = None, *, source: str = "the sweep",
                        check: bool = True) -> ResultDocument:
        """A new document: this one with what a sweep concluded over its rows (`metrics`: keys of the sweep's
        namespace, set or set again; `sections`: SECTIONS) merged in, its `conclusion` the whole of what was
        concluded so far. This document is left as it is (a saved one is frozen); so is its result.json: the
        conclusion is saved beside it (results.save_conclusion). Returns this document when nothing changes.
        `check` False: a conclusion read back (results.load_result), whose keys are not checked against today's
        namespaces (an old result, a plugin's, must still load; results.validate checks what readers rely on)."""
        metrics, sections = dict(metrics or {}), dict(sections or {})
        if check:
            check_declared(metrics, [NAMESPACE_SWEEP, *row_namespaces(self.technique, self.config, self.engine)], source)
        unknown = sorted(set(sections) - set(SECTIONS))
        if unknown:
            raise KeyError(f"{', '.join(unknown)} is not a section of a result document ({', '.join(SECTIONS)})")
        before = self.conclusion or {}
        after = {"metrics": {**(before.get("metrics") or {}), **metrics},
                 "sections": {**(before.get("sections") or {}), **sections}}
        if all(_same(self.metrics.get(k), v) and k in self.metrics for k, v in metrics.items()) \
                and all(_same(getattr(self, k), v) for k, v in sections.items()):
            return self
        data = self.to_dict()
        data["metrics"] = {**data["metrics"], **_plain(metrics)}
        data.update(_plain(sections))
        out = ResultDocument.from_dict(data, location=self.location)
        object.__setattr__(out, "conclusion", after)
        if self.frozen:
            out.freeze()
        return out

    # ----------------------------------------------------------------- typed reads of `metrics`
    # What the report, compare, recommend and tune read on every row, in one place: a figure that is
    # absent, null, not a number or not finite reads as None (a result is untrusted input).
    def metric(self, key: str) -> float | None:
        """`metrics[key]` as a finite float, else None."""
        return self.metrics.number(key)

    def interval(self, key: str) -> tuple[float, float] | None:
        """`metrics[key + "_ci95"]` as (low, high) when it is two finite numbers in order, else None."""
        return self.metrics.interval(key)

    def stat(self, key: str, stat: str = "p50") -> float | None:
        """A statistic of a timing distribution (`stat("tpot_ms")`: its median), else None."""
        return self.metrics.stat(key, stat)

    @property
    def speedup(self) -> float | None:
        """Decode speedup against the baseline (`speedup_vs_baseline`: baseline TPOT p50 / this row's)."""
        return self.metric("speedup_vs_baseline")

    @property
    def speedup_ci95(self) -> tuple[float, float] | None:
        return self.interval("speedup_vs_baseline")

    @property
    def ttft_speedup(self) -> float | None:
        return self.metric("ttft_speedup_vs_baseline")

    @property
    def ttft_p50_ms(self) -> float | None:
        return self.stat("ttft_ms")

    @property
    def tpot_p50_ms(self) -> float | None:
        return self.stat("tpot_ms")

    @property
    def throughput_tok_s(self) -> float | None:
        """Output tokens per second of the whole run (`output_throughput_tok_s`)."""
        return self.metric("output_throughput_tok_s")

    @property
    def ppl_delta_pct(self) -> float | None:
        return self.metric("ppl_delta_pct")

    @property
    def bleu_drift(self) -> float | None:
        return self.metric("bleu_drift")

    @property
    def noise(self) -> dict[str, Any]:
        """`metrics.noise` ({} when the row has none)."""
        return self.metrics.noise

    @property
    def noisy(self) -> bool:
        """The noise figure flags the row (False when it has none)."""
        return bool(self.noise.get("noisy"))

    @property
    def rounds(self) -> dict[str, Any]:
        """`metrics.rounds` (RoundsBlock's keys; {} for a row not measured in rounds)."""
        return self.metrics.rounds

    # ----------------------------------------------------------------- JSON
    def to_dict(self) -> dict[str, Any]:
        """The document as written to `result.json` (never its `location`)."""
        doc = {f.name: _plain(getattr(self, f.name)) for f in fields(self) if f.name not in NOT_DATA}
        for key in ("objective",) + SECTIONS:
            if doc[key] is None:
                doc.pop(key)
        if self.engine is None:
            for key in ENGINE_KEYS:
                doc.pop(key)
        doc.update(_plain(self.extra))
        return doc

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], location: str | Path | None = None, *,
                  drop: tuple[str, ...] = ()) -> ResultDocument:
        """A document from its JSON keys (validated by the caller: results.validate); unknown top-level keys
        go to `extra`. `drop`: bulky parts left out as it is read (`leaderboard` keeps no `samples`: emptied,
        never written back)."""
        if isinstance(data, ResultDocument):
            data = data.to_dict()
        known = {f.name for f in fields(cls)} - set(NOT_DATA)
        data = {k: v for k, v in data.items() if k != "_path" and k not in drop or k == "samples"}
        if "samples" in drop:
            data["samples"] = {}
        kwargs = {k: v for k, v in data.items() if k in known}
        for key in ("runner", "protocol", "label", "fingerprint", "baseline_run_id"):
            kwargs.setdefault(key, None)
        return cls(**kwargs, extra={k: v for k, v in data.items() if k not in known},
                   location=Path(location) if location is not None else None)


# dataclass fields of ResultDocument that are not keys of its JSON
NOT_DATA = ("extra", "location", "conclusion")


# what a mapping made by hand (a test's row, a library caller's) gets for a required key it lacks
_EMPTY = {"run_id": "", "created_at": "", "tool": dict, "env": dict, "model": dict, "technique": None,
          "config": dict, "workload": dict, "metrics": dict, "samples": dict}


def as_document(doc: Mapping[str, Any]) -> ResultDocument:
    """`doc` itself when it is a ResultDocument (every result loaded or measured is one); a mapping made
    by hand becomes one, its blocks shared (not copied) and the required keys it lacks empty. The readers'
    entry points (report, compare, recommend, tune) call it, so they read typed documents only."""
    if isinstance(doc, ResultDocument):
        return doc
    if not isinstance(doc, Mapping):
        raise TypeError(f"a result document is a mapping, not {type(doc).__name__}")
    data = dict(doc)
    for key, empty in _EMPTY.items():
        if data.get(key) is None:
            data[key] = empty() if callable(empty) else empty
    return ResultDocument.from_dict(data)


def _plain(value: Any) -> Any:
    """A deep copy of JSON-shaped data (dicts, lists), so the written dict shares nothing with the object."""
    if isinstance(value, dict):  # a Metrics too: written as a plain dict
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value
