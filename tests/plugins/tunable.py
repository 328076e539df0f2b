"""Techniques `tune` searches that live outside infer_tune/: a base with three methods (one pruned by a
screen of its own) and a part that stacks on it, each saying what `tune` may try of it through its
registry entry alone (`tune=Tuning(...)`). `register()` adds them; `unregister()` takes them out again.

Both prepare the plain model (what is measured is the search, not a speed-up): `ScriptedExecutor`
stands in for the measurement where a test needs the figures fixed (tune hands every group of
candidates to the executor in scope, `infer_tune.executors.use`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from infer_tune.runners.prepared import PreparedModel
from infer_tune.tuners.base import (
    Offer,
    TechniqueConfig,
    TuneAsk,
    Tuning,
    register_technique,
    unregister_technique,
)

METHODS = ("t-fast", "t-slow", "t-pruned")
ESTIMATES = {"t-fast": 3.0, "t-slow": 1.5, "t-pruned": 0.5}  # what the base's own "screen" expects
PRUNED = "t-pruned cannot win on this host (a test screen says 0.50x)"


@dataclass
class BaseConfig(TechniqueConfig):
    technique: ClassVar[str] = "test-base"
    method: str = "t-fast"

    def label(self) -> str:
        return self.method


@dataclass
class PartConfig(TechniqueConfig):
    technique: ClassVar[str] = "test-part"
    kind: str = "cheap"

    def label(self) -> str:
        return f"part-{self.kind}"


def _prepare(loaded, config, ctx) -> PreparedModel:
    """The plain model; a fact of its own (`test_base` / `test_part`: the config's label) shows what ran."""
    return PreparedModel(loaded.model, loaded.tokenizer, label=config.label(),
                         metrics={config.technique.replace("-", "_"): config.label()})


def offer_base(ask: TuneAsk) -> list[Offer]:
    """The chosen methods as bases with a screen row each; t-pruned pruned with the reason."""
    if ask.on is not None:
        return []
    methods = [m for m in METHODS if ask.methods is None or m in ask.methods]
    return [Offer(BaseConfig(method=m), role="base", method=m, estimate=ESTIMATES[m],
                  screen={"decode": ESTIMATES[m], "screened": ask.loaded is not None},
                  reason=PRUNED if m == "t-pruned" else None) for m in methods]


def offer_part(ask: TuneAsk) -> list[Offer]:
    """On a test base: a cheap part (no compile) and two compiled ones, all likely winners (beside their
    base); on the first base only, a late part (after the base may win). Nothing on other bases' configs."""
    if not isinstance(ask.on, BaseConfig):
        return []
    out = [Offer(PartConfig(kind="cheap"), role="part")]
    if ask.compile:
        out += [Offer(PartConfig(kind=k), role="part", compiles=True) for k in ("c1", "c2")]
    if ask.first:
        out.append(Offer(PartConfig(kind="late"), role="part", beside=False))
    return out


def register() -> None:
    register_technique(BaseConfig, phase=0, tune=Tuning(offer=offer_base, methods=METHODS),
                       metric_keys={"test_base": "the test base's fact"})(_prepare)
    register_technique(PartConfig, phase=3, tune=Tuning(offer=offer_part),
                       metric_keys={"test_part": "the test part's fact"})(_prepare)


def unregister() -> None:
    unregister_technique(BaseConfig)
    unregister_technique(PartConfig)


class ScriptedExecutor:
    """An executor (infer_tune/executors.py's interface) that measures nothing: every config's decode
    speed-up over the baseline comes from `speeds` (label -> (point, low, high); others `default`), and
    each call's labels are kept in `groups` (one list per group of shared rounds)."""

    def __init__(self, speeds: dict[str, tuple[float, float, float]],
                 default: tuple[float, float, float] = (0.5, 0.4, 0.6)) -> None:
        self.speeds, self.default, self.groups = speeds, default, []

    def _docs(self, configs) -> tuple[dict, list[dict]]:
        self.groups.append([c.label() for c in configs])
        docs = []
        for config in configs:
            label = config.label()
            point, low, high = self.speeds.get(label, self.default)
            docs.append({"run_id": label, "label": label, "technique": config.technique, "config": config.to_dict(),
                         "metrics": {"tpot_ms": {"p50": 100 / point}, "ttft_ms": {"p50": 50.0},
                                     "speedup_vs_baseline": point, "speedup_vs_baseline_ci95": [low, high]}})
        baseline = {"run_id": "baseline", "label": "baseline", "technique": "baseline", "config": {},
                    "metrics": {"tpot_ms": {"p50": 100.0}, "ttft_ms": {"p50": 50.0}}}
        return baseline, docs

    def run_configs(self, spec, configs, progress=None):
        return self._docs(configs)

    def run_together(self, spec, configs, progress=None):
        return self._docs(configs)

    def close(self) -> None:
        pass
