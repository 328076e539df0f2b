"""Stacked configurations: several techniques applied in a defined order and measured as one row.

`StackConfig(configs=[QuantizeConfig(method="int4-rtn"), KVCacheConfig(impl="static", compile=True)])`
(in a recipe: `{technique: stack, configs: [{technique: quantize, method: int4-rtn}, {technique:
kv-cache, impl: static, compile: true}]}`). Each part is prepared by its own registry entry on the
model the previous part returned, in phase order whatever order they were given in: weights
(quantize) first, then the cache (kv-cache), then the decoding loop (speculate, lean). The parts'
`generate_kwargs`, `metrics`, `runner_options` and counters are merged (a key two parts set to
different values is refused), extra model bytes add up, and the runner is the one part that needs a
runner other than `generation` (two such parts cannot stack). Drift is against the plain baseline of
the same run, like every other row.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, ClassVar

from infer_tune.document import ResultDocument
from infer_tune.errors import ConfigError
from infer_tune.models import LoadedModel
from infer_tune.runners.prepared import PreparedModel, RunCounters
from infer_tune.tuners.base import (
    Conclusion,
    MeasuredRow,
    RunContext,
    TechniqueConfig,
    Tuning,
    configs_by_technique,
    entry_named,
    register_technique,
    technique_for,
)


def conflicts(names: list[str]) -> list[tuple[str, str, str]]:
    """(a, b, why) for each pair of `names` whose registry entries say they cannot share a stack."""
    found = []
    for a in names:
        entry = entry_named(a)
        for b, why in (entry.conflicts if entry else {}).items():
            if b in names and (b, a, why) not in found:
                found.append((a, b, why))
    return found


@dataclass
class StackConfig(TechniqueConfig):
    """Techniques applied in phase order (weights, cache, decoding loop) and measured as one row.

    configs: the parts, as technique configs or as recipe-style dicts `{technique: NAME, **fields}`.
    """

    technique: ClassVar[str] = "stack"

    configs: list[Any] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not isinstance(self.configs, list) or not self.configs:
            raise ConfigError("stack: configs must be a non-empty list of technique configs")
        parts = [self._part(i, c) for i, c in enumerate(self.configs)]
        names = [p.technique for p in parts]
        for name in set(names):
            if names.count(name) > 1:
                raise ConfigError(f"stack: technique '{name}' appears {names.count(name)} times; a stack applies "
                                  "each technique once")
        by_name = {p.technique: p for p in parts}
        for a, b, why in conflicts(names):
            if by_name[a].stacks_with(by_name[b]) or by_name[b].stacks_with(by_name[a]):
                continue  # this config is the conflict's exception (e.g. the native step's int8 cache with lean)
            raise ConfigError(f"stack: {' and '.join(sorted((a, b)))} cannot stack: {why}")
        self.configs = sorted(parts, key=lambda p: technique_for(p).phase)  # stable: equal phases keep their order

    @staticmethod
    def _part(index: int, part: Any) -> TechniqueConfig:
        if isinstance(part, StackConfig):
            raise ConfigError(f"stack: configs[{index}] is itself a stack; list its parts instead")
        if isinstance(part, TechniqueConfig):
            return part
        if not isinstance(part, dict) or "technique" not in part:
            raise ConfigError(f"stack: configs[{index}] needs a 'technique' key (got {part!r})")
        by_name = configs_by_technique()
        cls = by_name.get(part["technique"])
        if cls is None or cls is StackConfig:
            raise ConfigError(f"stack: configs[{index}] technique '{part['technique']}' is not one of "
                              f"{', '.join(sorted(n for n in by_name if n != 'stack'))}")
        params = {k: v for k, v in part.items() if k != "technique"}
        if params.get("kind") == cls.__name__:  # a stored result's config (to_dict) names its class: the same
            params.pop("kind")
        allowed = {f.name for f in dataclasses.fields(cls)}
        unknown = set(params) - allowed
        if unknown:
            raise ConfigError(f"stack: configs[{index}] ({part['technique']}) unknown fields "
                              f"{', '.join(sorted(unknown))}; allowed: {', '.join(sorted(allowed))}")
        return cls(**params)

    def to_dict(self) -> dict[str, Any]:
        return {"kind": type(self).__name__,
                "configs": [{"technique": p.technique, **p.to_dict()} for p in self.configs]}

    def label(self) -> str:
        return "+".join(p.label() for p in self.configs)

    def parts(self) -> list[TechniqueConfig]:
        return list(self.configs)

    def techniques(self) -> list[str]:
        return [p.technique for p in self.configs]

    def check_workload(self, workload) -> None:
        """Every part's constraints (batch size) hold for the workload."""
        for part in self.configs:
            part.check_workload(workload)


class StackCounters(RunCounters):
    """The parts' counters behind one object: reset and snapshot reach every part."""

    def __init__(self, parts: list[RunCounters]) -> None:
        super().__init__()
        self.parts = parts

    def reset(self) -> None:
        if self.held:
            return
        super().reset()
        for part in self.parts:
            part.reset()

    def snapshot(self) -> dict[str, Any]:
        merged = super().snapshot()
        for part in self.parts:
            merged.update(part.snapshot())
        return merged


def _merge(into: dict, new: dict, what: str, label: str) -> None:
    for key, value in new.items():
        if key in into and into[key] is not value and into[key] != value:
            raise ConfigError(f"stack: {label} sets {what} '{key}' to {value!r}, an earlier part set {into[key]!r}")
        into[key] = value


def _resolve(config: StackConfig, ctx: RunContext) -> StackConfig:
    parts = []
    for part in config.configs:
        entry = technique_for(part)
        parts.append(entry.resolve(part, ctx) if entry.resolve else part)
    return StackConfig(configs=parts)


def _preflight(loaded: LoadedModel, config: StackConfig, ctx: RunContext) -> None:
    for part in config.configs:
        entry = technique_for(part)
        if entry.preflight:
            entry.preflight(loaded, part, ctx)


def runner_of(config: StackConfig) -> str:
    """The one non-`generation` runner among the parts (else `generation`)."""
    runners = {technique_for(p).runner for p in config.configs} - {"generation"}
    if len(runners) > 1:
        raise ConfigError(f"stack: parts need different runners ({', '.join(sorted(runners))}); they cannot stack")
    return runners.pop() if runners else "generation"


def _finish(row: MeasuredRow) -> dict[str, bytes] | None:
    """Every part's own `finish` on the stacked run: a stack's row carries its parts' keys; and the thesis the
    stack tests (thesis.py: together against each alone, in the same rounds) where its parts have rows."""
    from infer_tune.tuners.stack.thesis import thesis

    files: dict[str, bytes] = {}
    for part in row.config.configs:
        entry = technique_for(part)
        if entry.finish:
            files.update(entry.finish(dataclasses.replace(row, config=part)) or {})
    claim = thesis(row.doc, row.baseline, row.earlier)
    if claim is not None:
        row.doc.add_metrics({"claims": [claim]}, source="stack thesis")
    return files or None


def as_part(doc: ResultDocument, name: str) -> ResultDocument | None:
    """The stack row seen as a row of its part `name` (its technique and its config; the same run id and
    metrics object), so the part's sweep-level hook reads it like one of its own; None without such a part."""
    for part in (doc.get("config") or {}).get("configs") or []:
        if isinstance(part, dict) and part.get("technique") == name:
            config = {k: v for k, v in part.items() if k != "technique"}
            if isinstance(doc, ResultDocument):
                return dataclasses.replace(doc, technique=name, config=config)
            return {**doc, "technique": name, "config": config}  # a hand-made row (the report's readers)
    return None


def _by_part(docs: list[dict]) -> dict[str, list[dict]]:
    """Part technique name -> the stack rows holding that part, each seen as the part's row."""
    out: dict[str, list[dict]] = {}
    for doc in docs:
        for part in (doc.get("config") or {}).get("configs") or []:
            name = part.get("technique") if isinstance(part, dict) else None
            view = as_part(doc, name) if name else None
            if view is not None:
                out.setdefault(name, []).append(view)
    return out


def _conclude(docs: list[ResultDocument], skipped: list) -> Conclusion:
    """Every part's own `conclude` over the stack rows that hold it (each seen as the part's row: batch's
    static vs continuous stacks on one trace get batching's claim and figures): the claim of the first part,
    in phase order, that judges one; every part's files, keys and sections."""
    out = Conclusion()
    for name, views in _by_part(docs).items():
        entry = entry_named(name)
        found = entry.conclude(views, []) if entry and entry.conclude else None
        if found is None:
            continue
        out.claim = out.claim if out.claim is not None else found.claim
        out.files.update(found.files)
        for run_id, keys in found.metrics.items():
            out.metrics.setdefault(run_id, {}).update(keys)
        for run_id, sections in found.sections.items():
            out.sections.setdefault(run_id, {}).update(sections)
    return out


def _report_columns(doc: dict, docs: list[dict]):
    """The lead of a part ranked on something other than decode speed (batch: throughput against static
    batching), read on the stack rows seen as that part's rows; other stacks lead with the decode speedup."""
    for part in reversed((doc.get("config") or {}).get("configs") or []):
        name = part.get("technique") if isinstance(part, dict) else None
        entry = entry_named(name) if name else None
        if entry and entry.report_columns and entry.objective != "decode":
            others = [v for v in (as_part(d, name) if d.get("technique") == "stack" else d for d in docs) if v]
            return entry.report_columns(as_part(doc, name), others)
    raise ValueError("no part declares report columns")  # the report falls back to the decode speedup


@register_technique(StackConfig, resolve=_resolve, preflight=_preflight, finish=_finish, conclude=_conclude,
                    report_columns=_report_columns, tune=Tuning(compose=lambda parts: StackConfig(configs=list(parts))),
                    # beyond its parts' keys (each part's namespace is the row's too: document.row_namespaces)
                    metric_keys={"stack": "the parts and how they merged", "claims": "the stack thesis (thesis.py)"})
def prepare_stack(loaded: LoadedModel, config: StackConfig, ctx: RunContext) -> PreparedModel:
    """Prepare each part on the previous part's model, in phase order, and merge what they hand the runner."""
    runner = runner_of(config)
    ctx = dataclasses.replace(ctx, stack_parts=tuple(config.configs))
    current = loaded
    generate_kwargs: dict[str, Any] = {}
    metrics: dict[str, Any] = {}
    options: dict[str, Any] = {}
    counters: list[RunCounters] = []
    cleanups = []
    extra_bytes = 0
    scorer = None  # a part's own perplexity scorer (the native step's int8 KV cache)
    parts_info = []
    model = loaded.model
    try:
        for part in config.configs:
            entry = technique_for(part)
            prepared = entry.prepare(current, part, ctx)
            label = f"{part.technique} ({part.label()})"
            _merge(generate_kwargs, prepared.generate_kwargs, "generate setting", label)
            _merge(options, prepared.runner_options, "runner option", label)
            metrics.update(prepared.metrics)
            if prepared.counters is not None:
                counters.append(prepared.counters)
            if prepared.cleanup:
                cleanups.append(prepared.cleanup)
            extra_bytes += prepared.extra_model_bytes
            scorer = prepared.scorer or scorer
            parts_info.append({"technique": part.technique, "label": part.label(), "runner": entry.runner})
            if prepared.model is not None:
                model = prepared.model
                current = LoadedModel(model=model, tokenizer=prepared.tokenizer, ref=loaded.ref, path=loaded.path)
    except BaseException:
        for fn in reversed(cleanups):
            fn()
        raise
    metrics["stack"] = parts_info

    def cleanup() -> None:
        for fn in reversed(cleanups):
            fn()

    return PreparedModel(model=model, tokenizer=loaded.tokenizer, generate_kwargs=generate_kwargs, metrics=metrics,
                         label=config.label(), device=ctx.device,
                         counters=StackCounters(counters) if counters else None, extra_model_bytes=extra_bytes,
                         runner_options=options, cleanup=cleanup if cleanups else None, runner=runner,
                         scorer=scorer)
