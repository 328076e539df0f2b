"""A serving engine's own settings, measured and searched: `bench --engine` and `tune --engine`
(docs/tune.md, "Tuning a deployed engine"; docs/endpoint.md, "Launching an engine").

Every row is a launch (infer_tune.engines.launch) started on loopback and driven by the endpoint runner and
its load generator, exactly as `bench --endpoint` drives a server; rows are written by the engine's writer
(`sweep.save_rows`) with `technique: "engine"` and `config.launch` (engine, settings, argv, the GGUF's
digest and its imatrix, the llama.cpp commit). Quality of a llama.cpp row is measured against the
engine's default launch (the f16 GGUF, default flags): BLEU drift, exact match and faithfulness of its
outputs against the default's, and perplexity by `llama-perplexity` on the suite's own text
(engines.calibrate), so `ppl_delta_pct` means what it means for an in-process row.

`tune --engine`: the candidates (`candidates`, sized to the budget) are all started at once (idle servers
wait), refused in preflight with the reason where they cannot run here, then measured with the default
launch in the sweep engine's interleaved rounds (infer_tune.rounds: >= 3 rounds, shuffled order, one ratio
per round, 95% intervals from infer_tune.metrics.stats). The winner is the row within the quality budget
whose ratio interval on the objective lies above 1 with the highest lower bound; none: the default launch. It is
written to `recommended.yaml`, a recipe naming the engine and its settings (its argv, GGUF and imatrix
under `provenance`), which `bench --recipe` launches again.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import shlex
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from infer_tune import atomic
from infer_tune.document import ResultDocument
from infer_tune.endpoint.config import EndpointConfig
from infer_tune.endpoint.probe import EveryRequestFailed
from infer_tune.engines import calibrate, crash
from infer_tune.engines import launch as lm
from infer_tune.engines.base import ENGINES
from infer_tune.errors import ConfigError
from infer_tune.metrics import deltas, noise
from infer_tune.report.recommend import ENGINE, ENGINE_OBJECTIVES, OBJECTIVES
from infer_tune.runners.base import Progress
from infer_tune.runners.prepared import PreparedModel
from infer_tune.scenarios import tune_plan
from infer_tune.scenarios.common import RunSpec
from infer_tune.scenarios.endpoint import EndpointRun, measure_endpoint, open_endpoint
from infer_tune.sweep import Measured, Row, RowSpec, build_document, save_rows
from infer_tune.workload import iter_prompts

TECHNIQUE = ENGINE
OBJECTIVE_RATIO = {objective: OBJECTIVES[objective] for objective in ENGINE_OBJECTIVES}


def searched_here(launch: lm.Launch) -> bool:
    """The launch's engine is searched on this host and measured against its default launch (engines.base
    `Engine.searched_here`: llama.cpp)."""
    return ENGINES[launch.engine].searched_here


def searched_engines() -> list[str]:
    return [e.name for e in ENGINES.values() if e.searched_here]


def calibration_text(spec: RunSpec) -> Path:
    """The suite's own text (its prompts and references in suite order, calibrate.TEXT_CHARS at most) as a
    file for llama.cpp's tools."""
    prompts = list(itertools.islice(iter_prompts(spec.workload), 2000))
    return calibrate.suite_text([p.text for p in prompts], [p.reference for p in prompts])


def launch_config(started: lm.Started) -> dict:
    return {"engine": started.launch.engine, "settings": started.launch.to_dict()["settings"],
            "launch": started.record()}


def launched_engine(started: lm.Started) -> dict:
    """A launch row's engine and argv (`RowSpec` / `measure_endpoint` keywords)."""
    return {"engine": started.launch.engine, "engine_argv": started.record()["argv"]}


def open_launch(stack: contextlib.ExitStack, spec: RunSpec, launch: lm.Launch, text: Path | None,
                startup_timeout_s: float = 300.0, answer_deadline_s: float | None = None) -> tuple[lm.Started, EndpointRun]:
    """Start `launch` (stopped when `stack` closes) and connect the endpoint runner to it (its first request).
    An engine that dies or hangs on the way raises `crash.EngineCrashed` (engines.crash), stopped at once:
    at the start (lm.started), or at its first request (killed by a signal, ended, or silent past
    `answer_deadline_s`, the requests' idle limit)."""
    with contextlib.ExitStack() as own:  # this launch's: stopped here if it fails, else handed to `stack`
        started = own.enter_context(lm.started(launch, threads=spec.threads, calibration=text,
                                               startup_timeout_s=startup_timeout_s))
        # ignore_eos: every launch generates the same number of tokens, so their times compare (as the reference
        # row of tune does); the outputs still compare token by token up to that length
        config = EndpointConfig(url=started.url, served_model=started.served_model, concurrency=launch.parallel(),
                                label=launch.label, ignore_eos=True,
                                **({"idle_timeout_s": answer_deadline_s} if answer_deadline_s else {}))
        model_given = not launch.model.lower().endswith(".gguf")
        began = time.monotonic()
        try:
            run = open_endpoint(dataclasses.replace(spec, model=launch.model), config, model_given=model_given)
        except Exception as exc:
            found = ended(started, "first request", grace_s=ENDING_GRACE_S)
            silent = isinstance(exc, EveryRequestFailed) and bool(exc.kinds & {"idle_timeout", "timeout"})
            if found is None and silent and time.monotonic() - began >= config.idle_timeout_s:
                found = crash.crash_of(launch, started.command, started.files, phase="first request",
                                       hung_after_s=config.idle_timeout_s, log_path=started.log_path)
            if found is None:
                raise
            raise crash.EngineCrashed(found) from exc
        run.weight_bytes = started.weight_bytes()
        run.env["endpoint"]["launched"] = started.record()
        stack.enter_context(own.pop_all())
    return started, run


ENDING_GRACE_S = 3.0  # how long a launch whose request just failed is given to finish dying


def ended(started: lm.Started, phase: str, grace_s: float = 0.0) -> crash.Crash | None:
    """The crash of a launch whose process has ended on its own (read before it is stopped), else None.
    `grace_s`: wait that long for it to end first (a request cut by the engine's death reaches the client
    before the kernel has the process reaped: polled at once, a SIGILL at the first request read as alive)."""
    code = started.process.poll()
    if code is None and grace_s > 0:
        try:
            code = started.process.wait(grace_s)
        except subprocess.TimeoutExpired:
            code = None
    if not crash.is_crash(code, phase):
        return None
    return crash.crash_of(started.launch, started.command, started.files, phase=phase, returncode=code,
                          log_path=started.log_path)


def crashed_doc(spec: RunSpec, found: crash.Crash, env: dict | None, objective: str | None = None) -> ResultDocument:
    """The result row of a launch (or an in-process engine's child, engines/crash.py `run_child`) that crashed:
    nothing measured, `engine_status: crashed` and `crash` (the
    signal or the hang, its log's tail, the reproducer); never eligible, never a winner."""
    from infer_tune import env as envinfo
    from infer_tune import results

    env = {k: v for k, v in (env or envinfo.collect_env(spec.threads)).items() if k != "endpoint"}
    argv = found.reproducer.get("argv") or []
    binary = found.reproducer.get("binary")
    engine = found.label.split(" ", 1)[0]
    in_process = engine in ENGINES and ENGINES[engine].starts == "in-process"
    build_key = "build" if in_process else "llama_cpp"  # a launched server's build, as its measured rows keep it
    doc = ResultDocument(
        run_id=results.new_run_id(TECHNIQUE, found.label), created_at=results.created_stamp(),
        tool=envinfo.tool_info(), env=env, model={"ref": spec.model}, technique=TECHNIQUE, label=found.label,
        config={"engine": engine, "settings": found.settings,
                "launch": {"engine": engine, "model": spec.model, "settings": found.settings,
                           "argv": [Path(binary).name] + argv if binary else argv,
                           **({build_key: found.reproducer["build"]} if found.reproducer.get("build") else {})}},
        runner=ENGINES[engine].runner if engine in ENGINES else "endpoint", workload=spec.workload.to_dict(),
        protocol=None, metrics={"measured": False},
        samples={}, objective=objective,
        fingerprint=results.fingerprint("engine-crashed", found.label, found.settings, found.how, found.phase))
    if engine in ENGINES:  # the engine, its build and the command line that crashed, as a measured row names them
        doc.set_engine(engine, found.reproducer.get("build") or ENGINES[engine].identity(),
                       [Path(binary).name] + argv if binary else argv)
    _mark(doc, engine_status="crashed", eligible=False, engine_reason=found.summary, crash=found.to_dict())
    return doc


def rounds_without_crashes(variants: list, inputs, workload, protocol_for, *, crash_of, seed: int = 0,
                           progress: Progress | None = None):
    """The sweep engine's interleaved rounds (rounds.run_rounds) over `variants` (the baseline first) of an
    in-process engine, where a candidate whose engine raises during them is a crash, not the end of the search:
    `crash_of(variant, exc)` gives its Crash, the variant is dropped and the rounds start again without it
    (interleaved rounds compare what ran in every round: what the others measured before is discarded).
    `protocol_for()`: the protocol of each start (the budget left). An exception of the baseline, or one that
    names no variant (rounds.VARIANT_ATTR), is raised as it came. Returns (outcome, the variants kept,
    [(dropped variant, its Crash)])."""
    from infer_tune import rounds

    kept, crashes = list(variants), []
    while True:
        for v in kept:
            v.warm, v.passes = None, []
        try:
            outcome = rounds.run_rounds(kept, inputs, workload, protocol_for(), seed=seed, progress=progress)
        except Exception as exc:
            name = getattr(exc, rounds.VARIANT_ATTR, None)
            if name is None or name == kept[0].name:
                raise
            bad = next(v for v in kept if v.name == name)
            found = crash_of(bad, exc)
            crashes.append((bad, found))
            kept.remove(bad)
            if progress:
                progress(f"{found.label}: {found.summary}; the rounds again without it", len(crashes), len(variants))
            continue
        return outcome, kept, crashes


def perplexity_of(started: lm.Started, text: Path | None, threads: int | None) -> dict | None:
    """llama-perplexity of the launch's GGUF on the suite's text, with the launch's KV cache types and flash
    attention (None: not llama.cpp, or no tool)."""
    from infer_tune.engines import llamacpp

    if not searched_here(started.launch) or text is None or llamacpp.tool("llama-perplexity") is None:
        return None
    return calibrate.perplexity(started.files["model"], text, threads=threads, flags=perplexity_flags(started.launch))


# the settings that change the numbers a launch computes, as llama-perplexity's flags (a quantized KV cache
# costs quality as a quantized weight does; flash attention changes the order of the sums)
PPL_FLAGS = {"cache_type_k": "-ctk", "cache_type_v": "-ctv", "flash_attn": "-fa"}


def perplexity_flags(launch: lm.Launch) -> list[str]:
    return [arg for key, flag in PPL_FLAGS.items() if key in launch.settings
            for arg in (flag, str(launch.settings[key]))]


def add_quality(doc: ResultDocument, ppl: dict | None, base_doc: ResultDocument | None) -> None:
    """The launch's perplexity (and its change against the default launch's) in the row (`add_metrics`:
    the engine measured no perplexity of its own, so nothing measured is replaced)."""
    if ppl is not None:
        doc.add_metrics({"ppl": ppl["ppl"], "ppl_stderr": ppl["ppl_stderr"], "ppl_source": "llama-perplexity",
                         "ppl_context": ppl["context"]}, source="llama-perplexity")
    ours, theirs = doc.metric("ppl"), base_doc.metric("ppl") if base_doc is not None else None
    if ours and theirs:
        doc.add_metrics({"ppl_delta_pct": 100.0 * (ours - theirs) / theirs}, source="the default launch's perplexity")


def default_launch(launch: lm.Launch) -> lm.Launch:
    """The engine's default launch of the same model: llama.cpp's f16 GGUF with default flags."""
    keep = {k: v for k, v in launch.settings.items() if k == "threads"}
    return lm.Launch(launch.engine, launch.model, keep)


# --------------------------------------------------------------------------- bench --engine
def _measure_launch(spec: RunSpec, launch: lm.Launch, text, progress: Progress | None, step: int):
    """Start one launch, measure it like `bench --endpoint`, its perplexity in the row; stopped on return.
    A launch that crashes (engines.crash) is its crashed row, with no outputs."""
    if progress:
        progress(f"launch {launch.label}", step, 2)
    with contextlib.ExitStack() as stack:
        try:
            started, run = open_launch(stack, spec, launch, text)
        except crash.EngineCrashed as exc:
            return crashed_doc(spec, exc.crash, None), None
        try:
            doc, outputs = measure_endpoint(run, spec, extra_config=launch_config(started), progress=progress,
                                            **launched_engine(started))
        except Exception:
            found = ended(started, "measurement")
            if found is None:
                raise
            return crashed_doc(spec, found, run.env), None
        found = ended(started, "measurement")
        if found is not None:  # it answered some requests, then died: its figures are not a launch's
            return crashed_doc(spec, found, run.env), None
        doc.technique = TECHNIQUE
        add_quality(doc, perplexity_of(started, text, spec.threads), None)
    return doc, outputs


def run_engine_bench(spec: RunSpec, launch: lm.Launch, *, against_default: bool = True,
                     progress: Progress | None = None) -> list[ResultDocument]:
    """One launch measured like `bench --endpoint`; for llama.cpp first the default launch (the row its
    drift, perplexity change and speedup are against) unless it is the default. Returns the saved docs."""
    text = calibration_text(spec) if searched_here(launch) else None
    default = default_launch(launch)
    rows: list[Row] = []
    base_doc = base_outputs = None
    if against_default and searched_here(launch) and launch.settings != default.settings:
        base_doc, base_outputs = _measure_launch(spec, default, text, progress, 0)
        if base_outputs is None:  # the default launch crashed: its row, and the launch measured on its own
            rows.append(Row(base_doc, []))
            base_doc = None
        else:
            _mark(base_doc, engine_status="default")
            rows.append(Row(base_doc, base_outputs))
    doc, outputs = _measure_launch(spec, launch, text, progress, 1)
    if outputs is None:
        return save_rows(spec.out_dir, rows + [Row(doc, [])])
    if base_doc is not None:
        doc.add_metrics(deltas.versus_baseline(doc.metrics, outputs, base_doc, base_outputs),
                        source="the comparison with the default launch")
        add_quality(doc, None, base_doc)
        doc.baseline_run_id = base_doc.run_id
    rows.append(Row(doc, outputs))
    return save_rows(spec.out_dir, rows)


def bench(spec: RunSpec, engine: str, settings: dict, *, progress: Progress | None = None) -> list[ResultDocument]:
    """`bench --engine E --set ...` of a launched engine (engines/base.py `Engine.scenario`): `run_engine_bench`
    of the launch of `spec.model` with those settings."""
    return run_engine_bench(spec, lm.Launch(engine, spec.model, settings), progress=progress)


# --------------------------------------------------------------------------- tune --engine
@dataclass
class EngineTuneSpec:
    engine: str = field(default_factory=lambda: searched_engines()[0])
    max_ppl_delta: float = 5.0
    max_bleu_drift: float = 1.0
    objective: str = "decode"
    budget_s: float = 600.0
    seed: int = 0
    start_deadline_s: float = 300.0  # a launch silent past this before it answers /v1/models: crashed (hung)
    answer_deadline_s: float = 60.0  # ... or silent past this at a request (the requests' idle limit)

    def __post_init__(self) -> None:
        lm.check_engine(self.engine)
        for name in ("start_deadline_s", "answer_deadline_s"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"tune --engine: {name} must be > 0, got {getattr(self, name)}")
        if self.engine not in searched_engines():
            raise ConfigError(f"tune --engine {self.engine} needs its GPU: only {', '.join(searched_engines())} is "
                              "searched on this host "
                              "(bench --engine measures one vLLM / SGLang launch)")
        if self.objective not in OBJECTIVE_RATIO:
            raise ConfigError(f"tune --engine: --objective must be one of {', '.join(OBJECTIVE_RATIO)}, "
                              f"got {self.objective!r}")


def candidates(spec: EngineTuneSpec, model: str, threads: int | None = None) -> list[dict]:
    """The launches worth trying for the objective, cheapest evidence first, sized to the budget (about one
    candidate per budget minute, at least the first six: the formats with two 4-bit types beside their
    imatrix-calibrated twins)."""
    fa = {"flash_attn": "on"}
    # the formats first, each 4-bit type beside its imatrix-calibrated twin: Q4_K_M (the common choice) and
    # IQ4_XS (4.25 bits a weight on a non-linear grid: on this 2-core AVX-512 host llama-bench decodes SmolLM2
    # with it at about Q4_0's speed, 1.9x f16, where Q4_K_M is 1.2x; calibrated, its perplexity is +4.0% on the
    # suite's text against Q4_0's +25%: docs/results.md); then the KV cache and drafting settings on the
    # calibrated IQ4_XS, the fastest 4-bit type that screened inside a 5% perplexity budget
    calibrated = {"gguf": "imatrix-iq4_xs"}
    found: list[dict] = [{"gguf": "q8_0"}, {"gguf": "q4_0"}, {"gguf": "q4_k_m"}, {"gguf": "imatrix-q4_k_m"},
                         {"gguf": "iq4_xs"}, dict(calibrated), {"gguf": "imatrix-q4_0"}, {**calibrated, **fa},
                         {**calibrated, "cache_type_k": "q8_0", "cache_type_v": "q8_0", **fa}]
    if lm.amx_ready():
        # llama.cpp's AMX matmul (Q4_0 among its types), from the second build that keeps it: GGML_NATIVE's AMX
        # kernels died with SIGILL in ggml_backend_amx_mul_mat on this AMX Xeon, so a crash is a quarantined row
        found.insert(2, {"gguf": "q4_0", "amx": True})
    if spec.objective == "throughput":
        found[1:1] = [{"gguf": "q4_0", "parallel": 4}, {**calibrated, "parallel": 4}]
    elif spec.objective == "decode":
        # n-gram drafting from the prompt and the text so far (no draft model: SmolLM2-135M is the smallest
        # of its family, and a draft is worth its steps only when it is several times cheaper than the target)
        found.append({**calibrated, "spec_type": "ngram-simple"})
    return found[:max(6, int(spec.budget_s // 60))]


@dataclass
class EngineTuneOutcome:
    baseline: ResultDocument
    rows: list[ResultDocument]  # saved documents of the candidates measured
    refused: list[dict]  # {label, settings, reason}
    winner: ResultDocument
    recommended: Path | None
    command: list[str]  # the winner's command line as it ran (the binary's full path): start it by hand
    elapsed_s: float
    notes: list[str] = field(default_factory=list)
    crashed: list[ResultDocument] = field(default_factory=list)  # saved rows of the launches that crashed

    def tried(self) -> list[dict]:
        return [table_row(d) for d in self.rows] + [
            {"label": r["label"], "status": "refused", "reason": r["reason"]} for r in self.refused] + [
            {**table_row(d), "reproducer": d["crash"]["reproducer"]["line"]} for d in self.crashed]

    def to_dict(self) -> dict:
        return {"winner": self.winner, "baseline": self.baseline, "tried": self.tried(),
                "recommended": str(self.recommended) if self.recommended else None, "command": self.command,
                "elapsed_s": self.elapsed_s, "notes": self.notes}


def table_row(doc: ResultDocument) -> dict:
    m = doc.metrics
    objective = doc.objective or "decode"
    ratio = m.get(OBJECTIVE_RATIO[objective])
    return {"label": doc.label, "status": doc.get("engine_status", "measured"), "eligible": doc.get("eligible"),
            "ratio": ratio, "ratio_ci95": m.get(OBJECTIVE_RATIO[objective] + "_ci95"),
            "decode_tok_s": 1000 / doc.tpot_p50_ms if doc.tpot_p50_ms else None,
            "ttft_p50_ms": doc.ttft_p50_ms, "throughput_tok_s": doc.throughput_tok_s,
            "ppl": m.get("ppl"), "ppl_delta_pct": m.get("ppl_delta_pct"), "bleu_drift": m.get("bleu_drift"),
            "bleu_vs_baseline": m.get("bleu_vs_baseline"), "exact_match": m.get("exact_match_vs_baseline"),
            "reason": doc.get("engine_reason")}


def report_columns(doc: ResultDocument, docs: list[ResultDocument]):
    """What the combined report leads an engine row with (report/leads.py `engine_columns`, which the report
    reads without importing this module)."""
    from infer_tune.report import leads

    return leads.engine_columns(doc, docs)


def quality_reasons(m: dict, spec: EngineTuneSpec) -> list[str]:
    """The quality budgets as `tune` applies them (tune_plan.quality_reasons)."""
    return tune_plan.quality_reasons(m, spec.max_ppl_delta, spec.max_bleu_drift)


def _mark(doc: ResultDocument, **keys) -> None:
    """Top-level keys of an engine row, set before it is saved (kept in `extra`, written as they are)."""
    doc.extra.update(keys)


def decide(docs: list[ResultDocument], spec: EngineTuneSpec) -> ResultDocument | None:
    """The winner: within the quality budget, its objective's ratio interval above 1, the highest lower bound
    of that interval (never a point estimate; a winner whose interval overlaps another's is noted)."""
    key = OBJECTIVE_RATIO[spec.objective]
    best = None
    for doc in docs:
        if doc.get("engine_status") == "crashed":  # nothing measured: never a winner
            continue
        why = quality_reasons(doc.metrics, spec)
        ci = doc.interval(key)
        if not why and not ci:
            why.append("no interval (fewer than two rounds)")
        elif not why and ci[0] <= 1.0:
            why.append(f"{key} interval [{ci[0]:.2f}, {ci[1]:.2f}] does not clear 1")
        _mark(doc, eligible=not why, engine_reason="; ".join(why) or None)
        if not why and (best is None or ci[0] > best.interval(key)[0]):
            best = doc  # the highest lower bound, as tune decides; an overlap is said after the search
    return best


def single_flag_gain(winner: ResultDocument, docs: list[ResultDocument], variants: dict, spec: EngineTuneSpec
                     ) -> dict | None:
    """The winner's gain over the best single-flag change: the eligible launch that changes one setting of the
    default (a plain GGUF type such as q4_k_m: what a llama.cpp user runs without searching), the highest lower
    bound of the objective's interval among them. Measured in the same rounds, so the ratio is paired per round
    (rounds.interval: winner against that launch). None without such a launch; the winner itself when it is one."""
    from infer_tune import rounds

    key = OBJECTIVE_RATIO[spec.objective]
    singles = [d for d in docs if d.get("eligible") and len(d.config.get("settings") or {}) == 1 and d.interval(key)]
    if not singles:
        return None
    best = max(singles, key=lambda d: d.interval(key)[0])
    if best is winner:
        return {"label": best.label, "settings": best.config["settings"], "point": 1.0, "ci95": [1.0, 1.0],
                "is_winner": True}
    found = rounds.interval(variants[id(best)], variants[id(winner)], rounds.RATIOS[key])
    return {"label": best.label, "settings": best.config["settings"], "point": found["point"] if found else None,
            "ci95": found["ci95"] if found else None, "is_winner": False}


def gain_line(winner: ResultDocument, key: str) -> str:
    """The winner's two gains: over the engine's default launch and over the best single-flag change."""
    ci = winner.interval(key) or (None, None)
    point = winner.metrics.get(key)
    text = f"gain ({key}): {point:.2f}x [{ci[0]:.2f}, {ci[1]:.2f}] over the default launch" if point and ci[0] \
        else f"gain ({key}) over the default launch: not measured"
    single = winner.get("gain_vs_single_flag")
    if single is None:
        return text + "; no single-flag change was eligible to compare with"
    if single["is_winner"]:
        return text + f"; the winner is itself the best single-flag change ({single['label']})"
    if single["point"] is None:
        return text + f"; over the best single-flag change ({single['label']}): no interval (too few rounds)"
    low, high = single["ci95"]
    return text + (f"; {single['point']:.2f}x [{low:.2f}, {high:.2f}] over the best single-flag change "
                   f"({single['label']})")


def _default_crashed(spec: RunSpec, found: crash.Crash, env: dict | None, tspec: EngineTuneSpec):
    """The default launch crashed: nothing to compare the others with. Its row is saved, then the search ends
    (EngineCrashed, exit 1, naming the row and the reproducer)."""
    saved = save_rows(spec.out_dir, [Row(crashed_doc(spec, found, env, tspec.objective))])
    raise crash.EngineCrashed(found, row=saved[0].location)


def _prepared(run: EndpointRun) -> PreparedModel:
    return PreparedModel(model=None, tokenizer=run.model.tokenizer, label=run.config.display_label(),
                         device="endpoint", metrics={"model_bytes": run.weight_bytes},
                         extra_model_bytes=run.weight_bytes or 0, runner_options={"endpoint": run.config})


def run_engine_tune(spec: RunSpec, tspec: EngineTuneSpec, *, settings_list: list[dict] | None = None,
                    progress: Progress | None = None) -> EngineTuneOutcome:
    """The search (module docstring): start, preflight, interleaved rounds, decide, write recommended.yaml."""
    from infer_tune import rounds

    start = time.monotonic()
    text = calibration_text(spec)
    default = lm.Launch(tspec.engine, spec.model, {})
    launches = [lm.Launch(tspec.engine, spec.model, s) for s in
                (settings_list if settings_list is not None else candidates(tspec, spec.model, spec.threads))]
    refused: list[dict] = []
    notes: list[str] = []
    crashes: list[crash.Crash] = []
    quarantine = crash.Quarantine()  # what crashed or was refused in this search is never started again
    deadlines = {"startup_timeout_s": tspec.start_deadline_s, "answer_deadline_s": tspec.answer_deadline_s}
    with contextlib.ExitStack() as stack:
        if progress:
            progress(f"launch {default.label}", 0, len(launches) + 1)
        try:
            base_started, base_run = open_launch(stack, spec, default, text, **deadlines)
        except crash.EngineCrashed as exc:  # nothing to compare with: the crashed row, then the end
            _default_crashed(spec, exc.crash, None, tspec)
        live: list[tuple[lm.Launch, lm.Started, EndpointRun]] = []
        for i, launch in enumerate(launches):
            if progress:
                progress(f"launch {launch.label}", i + 1, len(launches) + 1)
            if launch in quarantine:  # the same configuration again: not started twice
                notes.append(f"{launch.label} is listed again: quarantined ({quarantine.why(launch)}), not retried")
                continue
            files = lm.resolve_files(launch, threads=spec.threads, calibration=text)
            why = lm.preflight(launch, files, lm.model_config(launch))
            if why:
                refused.append({"label": launch.label, "settings": launch.to_dict()["settings"], "reason": why})
                quarantine.add(launch, "refused")
                continue
            try:
                started, run = open_launch(stack, spec, launch, text, **deadlines)
            except crash.EngineCrashed as exc:  # a crash is a row of its own; the search goes on without it
                crashes.append(exc.crash)
                quarantine.add(launch, exc.crash.summary)
                continue
            except Exception as exc:  # noqa: BLE001 (a launch the engine refuses is a refused row, not the end)
                refused.append({"label": launch.label, "settings": launch.to_dict()["settings"],
                                "reason": f"did not start: {str(exc).splitlines()[0][:200]}"})
                quarantine.add(launch, "did not start")
                continue
            live.append((launch, started, run))
        spent = time.monotonic() - start
        protocol = dataclasses.replace(spec.protocol, max_duration_s=max(30.0, 0.8 * (tspec.budget_s - spent)))
        before = noise.HostSnapshot.take()
        while True:  # a launch that dies during the rounds is a crash: the rounds again without it (once each)
            variants = [rounds.Variant("default", _prepared(base_run), "endpoint")] + [
                rounds.Variant(f"{i}:{launch.label}", _prepared(run), "endpoint")
                for i, (launch, _, run) in enumerate(live)]
            try:
                outcome = rounds.run_rounds(variants, base_run.inputs, spec.workload, protocol, seed=tspec.seed,
                                            progress=progress)
                failed = None
            except Exception as exc:  # noqa: BLE001 (re-raised below unless a launch died)
                failed = exc
            grace = ENDING_GRACE_S if failed is not None else 0.0  # a failed round: was it a death?
            found = ended(base_started, "measurement", grace_s=grace)
            if found is not None:
                _default_crashed(spec, found, base_run.env, tspec)
            dead = [(x, found) for x in live if (found := ended(x[1], "measurement", grace_s=grace)) is not None]
            for (launch, _, _), found in dead:
                crashes.append(found)
                quarantine.add(launch, found.summary)
            kept = [(x, v) for x, v in zip(live, variants[1:]) if all(x is not d for d, _ in dead)]
            live, variants = [x for x, _ in kept], variants[:1] + [v for _, v in kept]
            if failed is not None and not dead:
                raise failed
            if failed is None:
                break
        host = (before, noise.HostSnapshot.take())
        base_doc, base_outputs = build_document(
            Measured(base_run.model, variants[0].prepared, rounds.merged_run(variants[0]), base_run.inputs,
                     spec.workload, protocol, host, rounds_block=outcome.block("default")),
            RowSpec(TECHNIQUE, launch_config(base_started), "endpoint", base_run.env, measure_ppl=False,
                    **launched_engine(base_started)))
        add_quality(base_doc, perplexity_of(base_started, text, spec.threads), None)
        base_doc.objective = tspec.objective
        rows = [Row(base_doc, base_outputs)]
        for (_, started, run), variant in zip(live, variants[1:]):
            doc, outputs = build_document(
                Measured(run.model, variant.prepared, rounds.merged_run(variant), run.inputs, spec.workload, protocol,
                         host, outcome.block(variant.name), outcome.intervals.get(variant.name)),
                RowSpec(TECHNIQUE, launch_config(started), "endpoint", run.env, measure_ppl=False,
                        baseline=base_doc, baseline_outputs=base_outputs, **launched_engine(started)))
            add_quality(doc, perplexity_of(started, text, spec.threads), base_doc)
            doc.objective = tspec.objective
            rows.append(Row(doc, outputs))
        winner = decide([r.doc for r in rows[1:]], tspec)
        if winner is not None:
            by_doc = {id(r.doc): v for r, v in zip(rows, variants)}
            _mark(winner, gain_vs_single_flag=single_flag_gain(winner, [r.doc for r in rows[1:]], by_doc, tspec))
        _mark(base_doc, eligible=True, engine_status="default")
        for r in rows[1:]:
            _mark(r.doc, engine_status="winner" if r.doc is winner else "measured")
        winner_started = next((s for (_, s, _), r in zip(live, rows[1:]) if r.doc is winner), base_started)
    crashed_rows = [Row(crashed_doc(spec, found, base_run.env, tspec.objective)) for found in crashes]
    saved = save_rows(spec.out_dir, [r for r in rows] + crashed_rows)
    saved, crashed_docs = saved[:len(rows)], saved[len(rows):]
    base_doc, docs = saved[0], saved[1:]
    winner_doc = next((d for d in docs if d.get("engine_status") == "winner"), base_doc)
    if winner is not None:
        key = OBJECTIVE_RATIO[tspec.objective]
        low = winner.interval(key)[0]
        notes.append(gain_line(winner_doc, key))
        close = [d.label for d in docs if d.get("eligible") and d is not winner_doc
                 and (d.interval(key) or (0, 0))[1] >= low]
        if close:
            notes.append(f"the winner's {key} interval overlaps {', '.join(close)}'s: not separated from "
                         f"{'it' if len(close) == 1 else 'them'} on this run (the highest lower bound wins; measure more rounds to separate them)")
    else:
        notes.append("no launch's interval cleared the default launch within the quality budget: the default stands")
    recommended = write_recommended(spec, winner_started, winner_doc)
    return EngineTuneOutcome(baseline=base_doc, rows=docs, refused=refused, winner=winner_doc,
                             recommended=recommended, command=list(winner_started.command),
                             elapsed_s=time.monotonic() - start, notes=notes, crashed=crashed_docs)


def tune_spec(engine: str, **budgets) -> EngineTuneSpec:
    """`tune --engine E`'s spec for a launched engine (engines/base.py `Engine.scenario`)."""
    return EngineTuneSpec(engine=engine, **budgets)


def tune(spec: RunSpec, tspec: EngineTuneSpec, *, progress: Progress | None = None) -> EngineTuneOutcome:
    return run_engine_tune(spec, tspec, progress=progress)


def write_recommended(spec: RunSpec, started: lm.Started, doc: ResultDocument) -> Path:
    """`OUT/recommended.yaml`: a recipe of the launch (infer_tune/recipe.py: engine, model, settings, the
    workload) and, under `provenance`, its argv, the command line that ran (to start it by hand: `command`),
    its GGUF(s), the engine's build, the result and its measured figures."""
    record = started.record()
    settings = {**record["settings"], **({"threads": str(spec.threads)} if spec.threads else {})}
    return write_engine_recipe(spec, record["engine"], record["model"], settings, doc,
                               {"argv": record["argv"], "command": shlex.join(started.command),
                                "gguf": record.get("gguf"), "llama_cpp": record.get("llama_cpp")})


MEASURED_IN_RECIPE = ("speedup_vs_baseline", "speedup_vs_baseline_ci95", "ppl_delta_pct", "bleu_drift",
                      "bleu_vs_baseline")


def write_engine_recipe(spec: RunSpec, engine: str, model: str, settings: dict, doc: ResultDocument,
                        provenance: dict) -> Path:
    """`OUT/recommended.yaml` of an engine's winner in the recipe format that names its engine (engine, model,
    settings, the workload), `provenance` (how it ran) with the result and its measured figures added."""
    body = {"description": f"the winner of tune --engine {engine}", "model": model, "engine": engine,
            "settings": settings, "workload": spec.workload.to_dict(),
            "provenance": {**provenance, "result": str(doc.location) if doc.location else None,
                           "measured": {k: doc.metrics.get(k) for k in MEASURED_IN_RECIPE}}}
    path = Path(spec.out_dir) / "recommended.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic.write_text(path, yaml.safe_dump(body, sort_keys=False))
    return path
