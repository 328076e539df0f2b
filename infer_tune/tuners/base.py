"""The technique registry: one dict, filled by `@register_technique(ConfigClass, **options)`.

A technique is a config dataclass (validates itself in `__post_init__`, naming the field, the
allowed values and what it received) plus one registered entry: a `prepare(loaded, config, ctx)`
function that returns a `PreparedModel`, and the entry's options (`Technique`, built by keyword):
the runner that measures it, its hooks (before measuring: `resolve`, `preflight`; after: `finish` once
per row, `conclude` once per sweep), the report's lead and what `tune` may try of it (`Tuning`).
How to add one: docs/architecture.md, "Adding a technique".
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from infer_tune.document import ResultDocument
from infer_tune.errors import ConfigError
from infer_tune.metrics import schema as metric_schema
from infer_tune.models import LoadedModel
from infer_tune.runners.prepared import PreparedModel

TECHNIQUES_PACKAGE = "infer_tune.tuners"  # every module or package in it registers itself on import

Progress = Callable[[str, int, int | None], None]


@dataclass
class TechniqueConfig:
    """Base of every technique config; `technique` is the result's `technique` value."""

    technique: ClassVar[str] = ""
    max_batch_size: ClassVar[int | None] = None  # the largest batch it runs (speculate, lean, llama-cpp: 1)

    def to_dict(self) -> dict[str, Any]:
        return {"kind": type(self).__name__, **dataclasses.asdict(self)}

    def parts(self) -> list[TechniqueConfig]:
        """The technique configs this config applies (a stack lists its parts; anything else is itself)."""
        return [self]

    def label(self) -> str:
        """Short human summary for leaderboards and run ids."""
        return ",".join(f"{k}={v}" for k, v in dataclasses.asdict(self).items() if v is not None)

    def stacks_with(self, other: TechniqueConfig) -> bool:
        """Whether this config may share a stack with `other` although their techniques conflict (a registry
        entry's `conflicts`, by technique): default never."""
        return False

    def check_workload(self, workload) -> None:
        """Refuse a workload this config cannot run, before anything loads (default: `max_batch_size`)."""
        if self.max_batch_size is not None and workload.batch_size > self.max_batch_size:
            raise ConfigError(f"{self.technique} runs at batch size <= {self.max_batch_size}; "
                              f"the workload asks for batch size {workload.batch_size}")

    def workload_for(self, workload):
        """The workload this config runs: the sweep's (default), or its own (a batch-size sweep row runs at its
        own batch size); the engine encodes the inputs again for it and measures the row alone."""
        return workload

    def runs_on(self) -> str | None:
        """The registered engine (infer_tune/engines) this config runs on, or None: the stack's other parts
        say, else the default in-process engine (torch). A result's `engine` (engines.base.engine_of)."""
        return None

    def applicable_fields(self) -> tuple[str, ...]:
        """The fields that mean something for this config (what is printed and saved in a recipe);
        a technique whose knobs depend on its method overrides this (quantize: no alpha for int8-dynamic)."""
        return tuple(f.name for f in dataclasses.fields(self))


@dataclass
class RunContext:
    """What a technique gets besides the model: where it runs and what it may use.

    `load_model(ref)` loads a secondary model (a draft, say) on the same device and dtype;
    `artifact_dir(config)` is where a technique may save what it builds (a quantized checkpoint):
    a folder the caller chose, or one in a scratch area deleted after the run.
    """

    device: str = "cpu"
    dtype: str = "auto"
    threads: int = 1
    out_dir: Path = Path("runs")
    env: dict = field(default_factory=dict)
    progress: Progress | None = None
    save_dirs: dict[str, Path] = field(default_factory=dict)
    scratch_dir: Path | None = None
    trust_remote_code: bool = False
    cache: dict = field(default_factory=dict)  # shared by the configs of one run (calibration batches...)
    stack_parts: tuple = ()  # inside a stack: every part's config (a part that configures another reads it here)

    def load_model(self, ref: str) -> LoadedModel:
        from infer_tune import models

        return models.load(ref, dtype=self.dtype, device=self.device, trust_remote_code=self.trust_remote_code)

    def artifact_dir(self, config: TechniqueConfig) -> Path:
        label = config.label()
        if label in self.save_dirs:
            return self.save_dirs[label]
        if self.scratch_dir is None:  # callers that run sweeps pass their own and delete it
            import atexit
            import shutil

            from infer_tune import atomic

            self.scratch_dir = atomic.artifacts_dir()
            atexit.register(shutil.rmtree, self.scratch_dir, True)
        return self.scratch_dir / "".join(c if c.isalnum() or c in "-._" else "-" for c in label)


PrepareFn = Callable[[LoadedModel, Any, RunContext], PreparedModel]


@dataclass(frozen=True)
class TuneAsk:
    """What `tune` tells a technique when it asks what to try (docs/tune.md, "What a technique offers").

    The search: `objective` (decode, ttft, throughput or goodput), `compile` (candidates that compile a
    step are allowed), `require_lossless`, `budget_s` (the whole search's time budget), `methods` (the
    `--methods` names chosen; None: all), `reference` (reference rows are wanted), and for the serving
    objectives `rate` / `seed` of the arrival trace. The host: `loaded` (the model in front of it; None when only planning, nothing is screened)
    `prefill_rows` (the prompts' median length), `prompt_tokens` (every prompt's length in tokens) and
    `max_new_tokens` (new tokens per request). `on`: an earlier winner to stack on (None: asked
    for the technique's own rows); `first`: `on` is the first winner stacked (what is costly to try is
    tried on it alone).
    """

    objective: str = "decode"
    compile: bool = True
    require_lossless: bool = False
    budget_s: float = 1200.0
    methods: tuple[str, ...] | None = None
    reference: bool = True
    rate: float = 1.0
    seed: int = 0
    loaded: Any = None
    prefill_rows: int = 64
    prompt_tokens: tuple[int, ...] = ()
    max_new_tokens: int = 128
    on: Any = None
    first: bool = False


ROLES = ("single", "base", "part", "reference")


@dataclass
class Offer:
    """One config a technique offers `tune`, and how it takes part in the search.

    - `role`: `single` (measured on its own), `base` (measured on its own, most promising first by
      `estimate`; the first bases that may win get every technique's `part`s stacked on them), `part`
      (offered when asked `on` a base: stacked with it by the technique that composes stacks), or
      `reference` (measured once after the search, the winner compared with it; `reason` says why it
      cannot run here).
    - `lossless`: claims the baseline's outputs token for token (held to it); `compiles`: pays a compile
      (the budget expects more of it).
    - `beside` (parts): may be measured in the same rounds as its base, before the base's own row says
      whether it may win; False: only after it may (and never beside the first base).
    - `method`: the `--methods` name a base stands for; `estimate` / `estimate_ci95` / `screen`: what a
      screen on this host found (the speedup it expects, its 95% interval, the whole screen row,
      reported as `kernel_screen`); `reason`: why it cannot win here (a base or single is pruned with it).
    """

    config: Any
    role: str = "single"
    lossless: bool = False
    compiles: bool = False
    beside: bool = True
    method: str | None = None
    estimate: float | None = None
    estimate_ci95: list[float] | None = None
    screen: dict | None = None
    reason: str | None = None

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"offer role must be one of {', '.join(ROLES)}; got '{self.role}'")


@dataclass(frozen=True)
class Tuning:
    """What `tune` may try of a technique (the entry's `tune=` option).

    - `offer(ask) -> [Offer]`: its candidates for a search (`TuneAsk`): its own rows when `ask.on` is None,
      the parts it would stack on the base `ask.on` otherwise; an empty list when it has nothing to offer.
    - `methods`: the names `tune --methods` chooses among (the bases it offers, by `Offer.method`).
    - `compose(parts) -> config`: the technique that stacks configs (one part per technique, in phase order).
    """

    offer: Callable[[TuneAsk], list[Offer]] | None = None
    methods: tuple[str, ...] = ()
    compose: Callable[[list], Any] | None = None


@dataclass
class MeasuredRow:
    """What a technique's `finish` hook gets once one of its rows is measured, while the prepared model still
    exists: the config, the built result (`doc`, typed) and its outputs rows, what ran (`prepared`, the runner's
    raw `run`, the encoded `inputs`), the run's context, the rows of the sweep measured before it and the baseline."""

    config: TechniqueConfig
    doc: ResultDocument
    outputs: list[dict]
    prepared: PreparedModel
    run: Any  # runners.GenerationRun
    inputs: Any  # workload.Inputs
    ctx: RunContext
    earlier: list[ResultDocument] = field(default_factory=list)
    baseline: ResultDocument | None = None  # what the row was measured against (its rounds' baseline)


@dataclass
class Conclusion:
    """What a sweep-level hook concludes over the rows it is given (a technique's `conclude`, or a command's
    `SweepPlan.conclude`); the engine merges it into those rows (new documents: a saved row is never modified)
    and saves it beside only the results its sweep saved (results.save_conclusion), never in their result.json.

    - `claim`: stored as `metrics.claim_check` in every row (the claims table reads it there).
    - `files`: {file name: bytes}, written into every row's folder (figures the HTML report shows).
    - `metrics`: {run id: keys} added to that row's `metrics` (keys over the sweep, of the sweep's namespace or
      the row's: set, or set again).
    - `sections`: {run id: {section: value}} set on that row (`ResultDocument.set_section`).
    """

    claim: dict | None = None
    files: dict[str, bytes] = field(default_factory=dict)
    metrics: dict[str, dict[str, Any]] = field(default_factory=dict)
    sections: dict[str, dict[str, Any]] = field(default_factory=dict)


@dataclass(frozen=True)
class Technique:
    """One registry entry.

    - `runner`: the runner that measures the prepared model (`generation`, `speculative`, `trace`,
      `multiprocess`; see infer_tune.runners).
    - `measure_ppl`: whether perplexity means something for this technique (the model's logits change).
    - `objective`: what the recommender and `tune` rank this technique's rows on (a key of
      report.recommend.OBJECTIVES: `decode` for single-stream techniques, `throughput` for batching).
    - `phase`: where the technique goes in a stack (lower first: weights 0, cache 1, decoding loop 2-3).
    - `conflicts`: {other technique: why the two cannot share a stack}.
    - `resolve(config, ctx) -> config`: settle host-dependent choices (e.g. a backend `auto`) so the
      result and the fingerprint record what really ran.
    - `preflight(loaded, config, ctx)`: checks that need the model, run for every config of a sweep
      before anything is measured, so bad input fails before a result is written.
    - `finish(row: MeasuredRow) -> {file name: bytes} | None`: once per row, after the runner ran and while
      the prepared model still exists, before the result is saved: facts measured then (a cache probe,
      the trace replayed), facts judged against the rows measured before it in the sweep (`row.earlier`:
      the INT8 claim against a 16-bit row), added to `row.doc` through `add_metrics`; the files returned
      are saved with the result. Whatever command or recipe ran the technique, its document is the same.
    - `conclude(docs, skipped) -> Conclusion | None`: once per sweep, over every result of the technique
      in it and the configs it skipped (`sweep.Skipped`): a claim that needs them all (static vs
      continuous at the same rate, each suite's fastest draft), figures, keys and sections over the sweep
      (the batch-size sweep's knee); the engine stores them (`Conclusion`).
    - `metric_keys`: {key: what it is} of every metric the technique's rows may carry beyond the core
      (metrics/schema.py CORE): its `prepare` facts, its runner's counters, what its `finish` adds. Its
      namespace: `ResultDocument.add_metrics` refuses a key no namespace of the row declares.
    - `report_columns(doc, docs) -> Lead`: what the combined report leads this technique's row with (the
      figures its claim is about and what they are compared with; infer_tune/report/leads.py). None:
      decode speedup vs the baseline.
    - `tune`: what `tune` may try of this technique and how it stacks (`Tuning`): its offers for a search,
      the `--methods` names it answers to, or how it composes a stack.

    What holds for one config rather than the technique is the config's (`TechniqueConfig`): the largest
    batch it runs (`max_batch_size`, `check_workload`) and the workload it runs at (`workload_for`).
    """

    config_cls: type
    prepare: PrepareFn
    runner: str = "generation"
    measure_ppl: bool = True
    objective: str = "decode"
    phase: int = 1
    conflicts: dict[str, str] = field(default_factory=dict)
    resolve: Callable[[Any, RunContext], Any] | None = None
    preflight: Callable[[LoadedModel, Any, RunContext], None] | None = None
    finish: Callable[[MeasuredRow], dict[str, bytes] | None] | None = None
    conclude: Callable[[list[ResultDocument], list[Any]], Conclusion | None] | None = None
    metric_keys: Mapping[str, str] = field(default_factory=dict)
    report_columns: Callable[[ResultDocument, list[ResultDocument]], Any] | None = None
    tune: Tuning | None = None

    @property
    def name(self) -> str:
        return self.config_cls.technique


TECHNIQUES: dict[type, Technique] = {}


def register_technique(config_cls: type, **options: Any) -> Callable[[PrepareFn], PrepareFn]:
    """Register `prepare(loaded, config, ctx) -> PreparedModel` for `config_cls`, the entry built by keyword
    from `options` (the fields of `Technique`; an unknown one is a TypeError naming it)."""
    if not getattr(config_cls, "technique", ""):
        raise TypeError(f"{config_cls.__name__} needs a `technique: ClassVar[str]` name")
    known = {f.name for f in dataclasses.fields(Technique)} - {"config_cls", "prepare"}
    unknown = sorted(set(options) - known)
    if unknown:
        raise TypeError(f"register_technique({config_cls.__name__}): unknown option(s) {', '.join(unknown)}; "
                        f"the entry's options are {', '.join(sorted(known))}")
    if "conflicts" in options:
        options["conflicts"] = dict(options["conflicts"] or {})

    def decorator(fn: PrepareFn) -> PrepareFn:
        TECHNIQUES[config_cls] = Technique(config_cls=config_cls, prepare=fn, **options)
        return fn

    return decorator


def unregister_technique(config_cls: type) -> None:
    """Remove an entry (tests register techniques of their own and take them out again)."""
    TECHNIQUES.pop(config_cls, None)


def load_techniques() -> None:
    """Import every technique module of infer_tune/tuners (a new technique is a new folder there)."""
    import pkgutil

    package = importlib.import_module(TECHNIQUES_PACKAGE)
    for info in pkgutil.iter_modules(package.__path__):
        if info.name != "base" and not info.name.startswith("_"):
            importlib.import_module(f"{TECHNIQUES_PACKAGE}.{info.name}")


def technique_for(config: TechniqueConfig) -> Technique:
    load_techniques()
    try:
        return TECHNIQUES[type(config)]
    except KeyError:
        raise ConfigError(f"no technique registered for {type(config).__name__}") from None


def apply(loaded: LoadedModel, config: TechniqueConfig, ctx: RunContext | None = None) -> PreparedModel:
    """Prepare `config` on `loaded` through its registry entry (the device comes from `ctx`)."""
    ctx = ctx or RunContext(device=loaded.device)
    prepared = technique_for(config).prepare(loaded, config, ctx)
    prepared.device = ctx.device
    return prepared


def entry_named(name: str) -> Technique | None:
    """The registry entry of the technique called `name` (None when there is none)."""
    load_techniques()
    return next((e for e in TECHNIQUES.values() if e.name == name), None)


def tuning_entries() -> list[Technique]:
    """The entries that say what `tune` may try of them (`tune=`), in registry order."""
    load_techniques()
    return [e for e in TECHNIQUES.values() if e.tune is not None]


def configs_by_technique() -> dict[str, type]:
    """Technique name -> its config class (the class a recipe's `technique:` key selects)."""
    load_techniques()
    return {cls.technique: cls for cls in TECHNIQUES}


def _declared_keys(name: str) -> Mapping[str, str] | None:
    """The `metric_keys` of the registered technique `name` (None when none is registered by that name)."""
    load_techniques()
    return next((entry.metric_keys for entry in TECHNIQUES.values() if entry.name == name), None)


metric_schema.set_technique_keys(_declared_keys)
