"""`tune --engine openvino`: OpenVINO GenAI's own settings searched within a quality budget (docs/engines.md,
"OpenVINO").

The same search as `tune --engine llama.cpp` (scenarios/engine_tune.py), in-process: the default is OpenVINO's
own default (the checkpoint exported at int8, default properties); the candidates are weight formats x KV-cache
precision x performance hint (and prompt lookup for the decode objective), sized to the budget. Every
candidate is exported (cached) and its pipeline built; one that cannot be is refused with the reason. All are
then measured with the default in the sweep engine's interleaved rounds (infer_tune.rounds: >= 3 rounds,
shuffled order, paired per-request ratios, 95% intervals). Quality of every row against the default:
perplexity on the suite's references from the exported model's own logits (engines.openvino.perplexity, the
in-process rows' text and scoring), `ppl_delta_pct` against the default's, and BLEU drift / exact match of the
greedy outputs. The winner (engine_tune.decide): within the budget, the ratio interval above 1 with the highest
lower bound; none: the default stands. Written to `recommended.yaml`, a recipe naming the engine and its
settings (the export folder and the pipeline's command under `provenance`).
"""

from __future__ import annotations

import dataclasses
import shlex
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from infer_tune.engines import crash
from infer_tune.engines import openvino as ovm
from infer_tune.errors import ConfigError
from infer_tune.metrics import noise
from infer_tune.metrics import perplexity as ppl_mod
from infer_tune.report.recommend import ENGINE as ENGINE_TECHNIQUE
from infer_tune.runners.base import Progress
from infer_tune.scenarios.common import RunSpec, open_run
from infer_tune.scenarios.engine_tune import (
    OBJECTIVE_RATIO,
    EngineTuneOutcome,
    _mark,
    crashed_doc,
    decide,
    rounds_without_crashes,
    write_engine_recipe,
)
from infer_tune.sweep import Measured, Row, RowSpec, build_document, save_rows

TECHNIQUE = ENGINE_TECHNIQUE


@dataclass
class OpenVINOTuneSpec:
    """`tune --engine openvino`'s budgets (the fields engine_tune.decide reads)."""

    engine: str = ovm.ENGINE
    max_ppl_delta: float = 5.0
    max_bleu_drift: float = 1.0
    objective: str = "decode"
    budget_s: float = 600.0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.objective not in OBJECTIVE_RATIO:
            raise ConfigError(f"tune --engine openvino: --objective must be one of {', '.join(OBJECTIVE_RATIO)}, "
                              f"got {self.objective!r}")


def candidates(spec: OpenVINOTuneSpec) -> list[dict]:
    """The settings worth trying, cheapest evidence first, about one per budget minute (at least four): the weight
    formats (int4 the memory-bound decode's best bet), then the KV cache's precision and the hint on int4."""
    int4 = {"weight_format": "int4"}
    found: list[dict] = [dict(int4), {"weight_format": "fp16"}, {**int4, "kv_cache_precision": "f16"},
                         {**int4, "hint": "THROUGHPUT"}, {"weight_format": "int8", "kv_cache_precision": "f16"},
                         {**int4, "ratio": 0.8}, {**int4, "sym": True}]
    if spec.objective == "decode":
        found.insert(4, {**int4, "prompt_lookup": True})
    return found[:max(4, int(spec.budget_s // 60))]


def _row_config(settings: ovm.Settings, prepared) -> dict:
    record = prepared.runner_options["export"]
    return {"engine": ovm.ENGINE, "settings": settings.to_dict(),
            "launch": {"engine": ovm.ENGINE, "start": "in-process", "settings": dataclasses.asdict(settings),
                       "export": record}}


@dataclass
class Measurement:
    """OpenVINO's default and each wanted setting measured in one set of interleaved rounds (`measure`)."""

    default: ovm.Settings
    base_folder: Path
    rows: list[Row]  # the default's first, then one per setting that built, in `live`'s order
    crashed: list  # unsaved rows of the settings whose child process died or hung (engines/crash.py)
    live: list[tuple[ovm.Settings, Path, object]]  # (settings, export folder, prepared) of each built setting
    refused: list[dict]
    started: float  # time.monotonic() at the start


def measure(spec: RunSpec, wanted: list[dict], *, objective: str, seed: int = 0, budget_s: float | None = None,
            probe_deadline_s: float | None = None, progress: Progress | None = None) -> Measurement:
    """The default (the int8 export, default properties, `spec.threads`) and every setting of `wanted` that
    exports and builds (one that does not is `refused` with its reason) measured in the sweep engine's
    interleaved rounds, each row with its perplexity from the exported model's logits and, against the
    default, `ppl_delta_pct`, the speed ratios with their intervals, BLEU drift and exact match. `budget_s`:
    the rounds end by then (what is left of it after the exports, at least 30 s); None: `spec.protocol`'s.
    Each configuration runs first in a child process (`ovm.probe_command`, at most `probe_deadline_s`, else
    ovm.PROBE_DEADLINE_S): one whose child dies by a signal or hangs is a `crashed` row (`crashed`, its reproducer) and is quarantined; a
    setting listed twice is built once; the default crashing saves its row and raises EngineCrashed. One that raises
    during the rounds is a `crashed` row too (phase `measurement`, engines/crash.py `exception_crash`), dropped from
    them, and the rounds start again without it (engine_tune.rounds_without_crashes)."""
    from infer_tune import rounds
    from infer_tune.runners.generation import eos_ids

    why = ovm.available()
    if why:
        raise ConfigError(f"engine {ovm.ENGINE}: {why}")
    start = time.monotonic()
    run = open_run(spec, progress)
    loaded, inputs = run.loaded, run.inputs
    checkpoint = Path(loaded.path)
    eos = eos_ids(loaded.model, loaded.tokenizer)
    scored = ppl_mod.reference_sequences(loaded.tokenizer, inputs.rendered, [p.reference for p in inputs.prompts])
    threads = {"threads": spec.threads} if spec.threads else {}
    default = ovm.Settings(**threads)
    refused: list[dict] = []
    crashed: list = []
    quarantine = crash.Quarantine()  # what crashed or was refused here is never built again in this search
    logs = Path(tempfile.mkdtemp(prefix="infer-tune-probe-"))

    def build(settings: ovm.Settings):
        """Export, then the engine run for a few tokens in a child process (engines/crash.py `run_child`): a child
        that dies or hangs raises EngineCrashed with its Crash and never reaches this process."""
        folder = ovm.export(checkpoint, settings, progress)
        target = crash.InProcess(ovm.ENGINE, spec.model, settings.to_dict(), settings.label)
        end = crash.run_child(target, ovm.probe_command(folder, settings),
                              deadline_s=probe_deadline_s or ovm.PROBE_DEADLINE_S,
                              log_path=logs / f"probe-{len(list(logs.iterdir()))}.log",
                              files={"ir": folder / "openvino_model.bin"})
        if end.crash is not None:
            raise crash.EngineCrashed(end.crash)
        if end.code != 0:
            raise ovm.OpenVINOError(f"the engine refused it: {(end.tail or [f'exit code {end.code}'])[-1]}")
        return folder, ovm.prepare(folder, settings, loaded.tokenizer, eos)

    try:
        base_folder, base_prepared = build(default)
    except crash.EngineCrashed as exc:  # nothing to compare with: its row, then the end (exit 1)
        saved = save_rows(spec.out_dir, [Row(crashed_doc(spec, exc.crash, run.ctx.env, objective))])
        raise crash.EngineCrashed(exc.crash, row=saved[0].location) from None
    live = []
    for i, values in enumerate(wanted):
        if progress:
            progress(f"{ovm.ENGINE} {values}", i + 1, len(wanted) + 1)
        label = f"{ovm.ENGINE} " + " ".join(f"{k}={v}" for k, v in values.items())
        try:
            settings = ovm.Settings.from_dict({**values, **threads})
        except ConfigError as exc:
            refused.append({"label": label, "settings": values, "reason": str(exc).splitlines()[0][:200]})
            continue
        target = crash.InProcess(ovm.ENGINE, spec.model, settings.to_dict(), settings.label)
        if target in quarantine:
            refused.append({"label": label, "settings": values,
                            "reason": f"listed again: quarantined ({quarantine.why(target)}), not retried"})
            continue
        try:
            folder, prepared = build(settings)
        except crash.EngineCrashed as exc:
            quarantine.add(target, exc.crash.summary)
            crashed.append(crashed_doc(spec, exc.crash, run.ctx.env, objective))
            continue
        except (ConfigError, ovm.OpenVINOError) as exc:
            quarantine.add(target, "refused")
            refused.append({"label": label, "settings": values, "reason": str(exc).splitlines()[0][:200]})
            continue
        live.append((settings, folder, prepared))
    used: list = []  # the protocol of each start of the rounds (one more after a configuration crashed in them)

    def protocol_for():
        spent = time.monotonic() - start
        used.append(spec.protocol if budget_s is None else
                    dataclasses.replace(spec.protocol, max_duration_s=max(30.0, 0.8 * (budget_s - spent))))
        return used[-1]

    variants = [rounds.Variant("default", base_prepared, ovm.ENGINE, objective=objective)] + [
        rounds.Variant(f"{i}:{s.label}", p, ovm.ENGINE, objective=objective) for i, (s, _, p) in enumerate(live)]
    of_variant = {v.name: entry for v, entry in zip(variants, [(default, base_folder, base_prepared), *live])}

    def crash_of(variant, exc) -> crash.Crash:
        """A configuration that raised during the rounds: its crashed row, quarantined, its pipeline freed."""
        settings, folder, prepared = of_variant[variant.name]
        target = crash.InProcess(ovm.ENGINE, spec.model, settings.to_dict(), settings.label)
        found = crash.exception_crash(target, exc, ovm.probe_command(folder, settings),
                                      {"ir": folder / "openvino_model.bin"})
        quarantine.add(target, found.summary)
        prepared.runner_options.pop("pipeline", None)
        return found

    before = noise.HostSnapshot.take()
    try:
        outcome, variants, dropped = rounds_without_crashes(variants, inputs, spec.workload, protocol_for,
                                                            crash_of=crash_of, seed=seed, progress=progress)
    except Exception as exc:
        if getattr(exc, rounds.VARIANT_ATTR, None) != "default":
            raise
        found = crash_of(variants[0], exc)  # the default raised: nothing to compare with, its row, then the end
        saved = save_rows(spec.out_dir, [Row(crashed_doc(spec, found, run.ctx.env, objective))])
        raise crash.EngineCrashed(found, row=saved[0].location) from exc
    crashed += [crashed_doc(spec, found, run.ctx.env, objective) for _, found in dropped]
    live = [of_variant[v.name] for v in variants[1:]]
    protocol = used[-1]
    host = (before, noise.HostSnapshot.take())
    env = run.ctx.env
    base_doc, base_outputs = build_document(
        Measured(loaded, base_prepared, rounds.merged_run(variants[0]), inputs, spec.workload, protocol, host,
                 rounds_block=outcome.block("default")),
        RowSpec(TECHNIQUE, _row_config(default, base_prepared), ovm.ENGINE, env, measure_ppl=False,
                engine=ovm.ENGINE))
    if progress:
        progress("perplexity", 0, len(live) + 1)
    base_ppl = ovm.perplexity(base_folder, default, scored)
    base_doc.add_metrics({"ppl": base_ppl, "ppl_source": "openvino logits"}, source="the exported model's logits")
    base_doc.objective = objective
    rows = [Row(base_doc, base_outputs)]
    for k, ((settings, folder, prepared), variant) in enumerate(zip(live, variants[1:])):
        doc, outputs = build_document(
            Measured(loaded, prepared, rounds.merged_run(variant), inputs, spec.workload, protocol, host,
                     outcome.block(variant.name), outcome.intervals.get(variant.name)),
            RowSpec(TECHNIQUE, _row_config(settings, prepared), ovm.ENGINE, env, measure_ppl=False,
                    baseline=base_doc, baseline_outputs=base_outputs, engine=ovm.ENGINE))
        if progress:
            progress("perplexity", k + 1, len(live) + 1)
        ppl = ovm.perplexity(folder, settings, scored)
        doc.add_metrics({"ppl": ppl, "ppl_source": "openvino logits"}, source="the exported model's logits")
        if ppl and base_ppl:
            doc.add_metrics({"ppl_delta_pct": 100.0 * (ppl - base_ppl) / base_ppl},
                            source="the default's perplexity")
        doc.objective = objective
        rows.append(Row(doc, outputs))
    for _, _, prepared in [(None, None, base_prepared), *live]:
        prepared.runner_options.pop("pipeline", None)  # the pipeline is freed before the rows are written
    shutil.rmtree(logs, ignore_errors=True)  # a crash kept its log's tail in its row
    return Measurement(default, base_folder, rows, crashed, live, refused, start)


def bench(spec: RunSpec, engine: str, settings: dict, *, progress: Progress | None = None) -> list:
    """`bench --engine openvino --set ...` (and `bench --recipe` of `tune --engine openvino`'s recommended.yaml):
    OpenVINO's default and, when `settings` differ from it, those settings, in the same interleaved rounds
    (`measure`, `spec.protocol`'s budget); the rows saved, the default marked `default`. A setting that cannot
    be exported or built is a ConfigError with its reason (nothing to measure)."""
    wanted = [settings] if settings != ovm.Settings().to_dict() else []
    m = measure(spec, wanted, objective="decode", progress=progress)
    if m.refused:
        raise ConfigError(f"{m.refused[0]['label']}: {m.refused[0]['reason']}")
    _mark(m.rows[0].doc, eligible=True, engine_status="default")
    for r in m.rows[1:]:
        _mark(r.doc, engine_status="measured")
    return save_rows(spec.out_dir, m.rows + [Row(doc) for doc in m.crashed])


def run_openvino_tune(spec: RunSpec, tspec: OpenVINOTuneSpec, *, settings_list: list[dict] | None = None,
                      progress: Progress | None = None) -> EngineTuneOutcome:
    """The search (module docstring)."""
    wanted = settings_list if settings_list is not None else candidates(tspec)
    m = measure(spec, wanted, objective=tspec.objective, seed=tspec.seed, budget_s=tspec.budget_s, progress=progress)
    rows, live, default, base_folder = m.rows, m.live, m.default, m.base_folder
    notes: list[str] = []
    base_doc = rows[0].doc
    winner = decide([r.doc for r in rows[1:]], tspec)
    _mark(base_doc, eligible=True, engine_status="default")
    for r in rows[1:]:
        _mark(r.doc, engine_status="winner" if r.doc is winner else "measured")
    saved = save_rows(spec.out_dir, rows + [Row(doc) for doc in m.crashed])
    base_saved, docs, crashed = saved[0], saved[1:len(rows)], saved[len(rows):]
    winner_doc = next((d for d in docs if d.get("engine_status") == "winner"), base_saved)
    if winner is None:
        notes.append("no setting's interval cleared OpenVINO's default within the quality budget: the default stands")
    else:
        key = OBJECTIVE_RATIO[tspec.objective]
        low = winner.interval(key)[0]
        close = [d.label for d in docs if d.get("eligible") and d.get("engine_status") != "winner"
                 and (d.interval(key) or (0, 0))[1] >= low]
        if close:
            notes.append(f"the winner's {key} interval overlaps {', '.join(close)}'s: not separated on this run")
    settings = next((s for (s, _, _), r in zip(live, rows[1:]) if r.doc is winner), default)
    folder = next((f for (_, f, _), r in zip(live, rows[1:]) if r.doc is winner), base_folder)
    recommended = write_recommended(spec, settings, folder, winner_doc)
    return EngineTuneOutcome(baseline=base_saved, rows=docs, refused=m.refused, winner=winner_doc,
                             recommended=recommended, command=launch_command(folder, settings),
                             elapsed_s=time.monotonic() - m.started, notes=notes, crashed=crashed)


def tune_spec(engine: str, **budgets) -> OpenVINOTuneSpec:
    """`tune --engine openvino`'s spec (engines/base.py `Engine.scenario`)."""
    return OpenVINOTuneSpec(engine=engine, **budgets)


def tune(spec: RunSpec, tspec: OpenVINOTuneSpec, *, progress: Progress | None = None) -> EngineTuneOutcome:
    return run_openvino_tune(spec, tspec, progress=progress)


def launch_command(folder: Path, settings: ovm.Settings) -> list[str]:
    """A command that builds the winner's pipeline by hand (the export folder, its properties)."""
    props = {k: (str(v) if k != "INFERENCE_NUM_THREADS" else v) for k, v in settings.properties().items()}
    props_text = ", ".join(f"{k}={v!r}" if k != "KV_CACHE_PRECISION" else f"{k}=ov.Type.{settings.kv_cache_precision}"
                           for k, v in props.items())
    extra = ", prompt_lookup=True" if settings.prompt_lookup else ""
    code = (f"import openvino as ov, openvino_genai as og; pipe = og.LLMPipeline({str(folder)!r}, 'CPU'"
            f"{', ' + props_text if props_text else ''}{extra})")
    return ["python", "-c", code]


def write_recommended(spec: RunSpec, settings: ovm.Settings, folder: Path, doc) -> Path:
    """`OUT/recommended.yaml` in the recipe format that names its engine (infer_tune/recipe.py: engine, model,
    settings, workload), the export folder, the command that builds the pipeline and the measured figures under
    `provenance`."""
    return write_engine_recipe(spec, ovm.ENGINE, spec.model, settings.to_dict(), doc,
                               {"export": str(folder), "command": shlex.join(launch_command(folder, settings))})
