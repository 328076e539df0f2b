"""One measured run, end to end: inputs -> runner -> metrics -> result document.

Every technique goes through `measure_prepared`; `ensure_baseline` measures (or reuses) the baseline
of the same workload so that speedups and drift are ratios taken side by side on one machine.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from infer_tune import env as envinfo
from infer_tune import models, results
from infer_tune.metrics import quality, roofline
from infer_tune.metrics.perplexity import reference_perplexity
from infer_tune.metrics.stats import summarize
from infer_tune.runners.generation import GenerationRun, Protocol, measure_generation
from infer_tune.runners.prepared import PreparedModel
from infer_tune.suites import Prompt
from infer_tune.workload import Workload, encode_batches, select_prompts, uses_template

Progress = Callable[[str, int, int | None], None]


@dataclass
class Inputs:
    prompts: list[Prompt]
    rendered: list[str]
    batches: list
    templated: bool


def prepare_inputs(loaded: models.LoadedModel, workload: Workload, prompts: list[Prompt] | None = None) -> Inputs:
    """Select the prompts that fit, render them (chat template) and tokenize them into batches."""
    prompts, rendered = select_prompts(workload, loaded.tokenizer, prompts)
    templated = uses_template(loaded.tokenizer, workload)
    batches = encode_batches(loaded.tokenizer, rendered, workload.batch_size, add_special_tokens=not templated)
    return Inputs(prompts=prompts, rendered=rendered, batches=batches, templated=templated)


def workload_block(workload: Workload, inputs: Inputs) -> dict:
    block = workload.to_dict()
    block.update({"prompts": len(inputs.prompts), "chat_template_applied": inputs.templated})
    return block


def run_fingerprint(loaded: models.LoadedModel, technique: str, config: dict, workload: Workload, env: dict,
                    execute: bool = False) -> str:
    """What makes two runs the same measurement: model, technique, config, workload, threads, machine."""
    return results.fingerprint(loaded.path, technique, config, workload.to_dict(), env["threads"], env["machine"],
                               execute)


def timing_metrics(run: GenerationRun) -> tuple[dict, dict]:
    """Distribution metrics and raw samples from the runner's per-token timestamps."""
    timed = [r for r in run.requests if r.token_ns]
    ttft = [r.ttft_ms for r in timed]
    tpot = [r.tpot_ms for r in timed if r.tpot_ms is not None]
    e2e = [r.e2e_ms for r in timed]
    itl = [gap for r in run.requests for gap in r.itl_ms]
    metrics = {"ttft_ms": summarize(ttft), "itl_ms": summarize(itl), "tpot_ms": summarize(tpot),
               "e2e_ms": summarize(e2e)}
    wall = run.measured_wall_s or float("nan")
    metrics["output_throughput_tok_s"] = run.generated_tokens / wall
    metrics["request_throughput_req_s"] = len(run.requests) / wall
    # prompt_index pairs each ttft/e2e (and tpot, when every request has 2+ tokens) sample with its prompt
    samples = {"ttft_ms": ttft, "tpot_ms": tpot, "e2e_ms": e2e, "itl_ms": itl,
               "prompt_index": [r.prompt_index for r in timed]}
    return metrics, samples


def measure_prepared(
    loaded: models.LoadedModel,
    prepared: PreparedModel,
    inputs: Inputs,
    workload: Workload,
    protocol: Protocol,
    *,
    technique: str,
    config: dict,
    env: dict,
    baseline: dict | None = None,
    baseline_outputs: list[dict] | None = None,
    measure_ppl: bool = True,
    execute: bool = False,
    per_position: bool = False,
    progress: Progress | None = None,
) -> tuple[dict, list[dict]]:
    """Run the workload on `prepared` and build its result document and outputs rows.

    `per_position=True` adds `per_position_ms` (mean latency of each decode step, in order).

    `execute=True` also runs the code suite's tests on the outputs (pass@1, sandboxed subprocesses).
    """
    run = measure_generation(prepared, inputs.batches, workload.max_new_tokens, protocol, progress=progress)
    metrics, samples = timing_metrics(run)
    if per_position:
        metrics["per_position_ms"] = run.per_position_ms()
    weight_bytes = models.model_bytes(prepared.model)
    mean_context = (sum(o.prompt_tokens for o in run.outputs) / max(len(run.outputs), 1)
                    + workload.max_new_tokens / 2)
    kv_read = roofline.kv_bytes_per_token(prepared.model.config) * mean_context * run.batch_size
    metrics.update(roofline.roofline(env["mem_bandwidth_gb_s"], weight_bytes, kv_read, run.batch_size,
                                     metrics["tpot_ms"]["p50"]))
    metrics.update({
        "peak_rss_bytes": run.peak_rss_bytes,
        "rss_before_bytes": run.rss_before_bytes,
        "peak_rss_delta_bytes": run.peak_rss_bytes - run.rss_before_bytes,
        "model_bytes": weight_bytes,
        "first_call_ms": run.first_call_ms,
        "warmup_s": run.warmup_s,
        "iterations": run.iterations,
        "generated_tokens": run.generated_tokens,
    })
    texts = [o.text for o in run.outputs]
    metrics.update(quality.reference_scores(texts, [p.reference for p in inputs.prompts]))
    metrics["ppl"] = (reference_perplexity(prepared.model, prepared.tokenizer, inputs.rendered,
                                           [p.reference for p in inputs.prompts], device=prepared.device)
                      if measure_ppl else None)
    if execute:
        from infer_tune.metrics.passk import pass_at_1

        metrics["pass_at_1"] = pass_at_1(inputs.prompts, texts)
    metrics.update(prepared.metrics)
    outputs = [{"prompt_id": inputs.prompts[o.prompt_index].id, "prompt": inputs.prompts[o.prompt_index].text,
                "output": o.text, "token_ids": o.token_ids, "prompt_tokens": o.prompt_tokens,
                "hit_eos": o.hit_eos, "reference": inputs.prompts[o.prompt_index].reference}
               for o in run.outputs]
    if baseline is not None and baseline_outputs is not None:
        metrics.update(versus_baseline(metrics, outputs, baseline, baseline_outputs))
    result = {
        "schema_version": results.SCHEMA_VERSION,
        "run_id": results.new_run_id(technique, prepared.label),
        "created_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "tool": envinfo.tool_info(),
        "env": env,
        # params: the logical parameter count of the source model (a quantized copy stores fewer
        # nn.Parameters); model_bytes: what the prepared model really stores
        "model": {"ref": loaded.ref, "path": loaded.path, "params": models.count_params(loaded.model),
                  "model_bytes": weight_bytes, "dtype": loaded.dtype},
        "technique": technique,
        "label": prepared.label,
        "config": config,
        "workload": workload_block(workload, inputs),
        "protocol": asdict(protocol),
        "metrics": metrics,
        "samples": samples,
        "baseline_run_id": baseline["run_id"] if baseline else None,
        "fingerprint": run_fingerprint(loaded, technique, config, workload, env, execute),
    }
    return result, outputs


def versus_baseline(metrics: dict, outputs: list[dict], baseline: dict, baseline_outputs: list[dict]) -> dict:
    """Speedup, BLEU drift, faithfulness and perplexity change against a baseline of the same workload."""
    base = baseline["metrics"]
    out: dict = {}
    b_tpot, c_tpot = base["tpot_ms"]["p50"], metrics["tpot_ms"]["p50"]
    out["speedup_vs_baseline"] = b_tpot / c_tpot if b_tpot and c_tpot else None
    b_ttft, c_ttft = base["ttft_ms"]["p50"], metrics["ttft_ms"]["p50"]
    out["ttft_speedup_vs_baseline"] = b_ttft / c_ttft if b_ttft and c_ttft else None
    b_thr = base.get("output_throughput_tok_s")
    out["throughput_ratio_vs_baseline"] = metrics["output_throughput_tok_s"] / b_thr if b_thr else None
    out["bleu_drift"] = (metrics["bleu"] - base["bleu"]) if metrics.get("bleu") is not None and base.get("bleu") is not None else None
    if metrics.get("pass_at_1") is not None and base.get("pass_at_1") is not None:
        out["pass_at_1_delta"] = metrics["pass_at_1"] - base["pass_at_1"]
    out.update(quality.faithfulness([o["output"] for o in outputs], [o["output"] for o in baseline_outputs],
                                    [o["token_ids"] for o in outputs], [o["token_ids"] for o in baseline_outputs]))
    if metrics.get("ppl") and base.get("ppl"):
        out["ppl_delta_pct"] = 100.0 * (metrics["ppl"] - base["ppl"]) / base["ppl"]
    else:
        out["ppl_delta_pct"] = None
    return out


def find_reusable_baseline(out_dir: Path, fingerprint: str) -> tuple[dict, list[dict]] | None:
    """A baseline result of the same fingerprint (model, workload, threads, machine) from today."""
    if not Path(out_dir).exists():
        return None
    today = time.strftime("%Y-%m-%d")
    for doc in reversed(results.find_results(out_dir)):
        if doc.get("technique") == "baseline" and doc.get("fingerprint") == fingerprint \
                and str(doc.get("created_at", "")).startswith(today):
            return doc, results.load_outputs(doc["_path"])
    return None


def ensure_baseline(
    loaded: models.LoadedModel,
    inputs: Inputs,
    workload: Workload,
    protocol: Protocol,
    *,
    env: dict,
    out_dir: Path,
    device: str = "cpu",
    reuse: bool = True,
    measure_ppl: bool = True,
    execute: bool = False,
    progress: Progress | None = None,
) -> tuple[dict, list[dict], bool]:
    """Reuse today's matching baseline from `out_dir`, or measure and save one. Returns (doc, outputs, reused)."""
    fp = run_fingerprint(loaded, "baseline", {}, workload, env, execute)
    if reuse:
        found = find_reusable_baseline(out_dir, fp)
        if found is not None:
            return found[0], found[1], True
    prepared = PreparedModel(model=loaded.model, tokenizer=loaded.tokenizer, label="baseline", device=device)
    doc, outputs = measure_prepared(loaded, prepared, inputs, workload, protocol, technique="baseline", config={},
                                    env=env, measure_ppl=measure_ppl, execute=execute, progress=progress)
    saved = results.save_run(out_dir, doc, outputs)
    doc["_path"] = str(saved.run_dir)
    return doc, outputs, False


def existing_result(out_dir: Path, fingerprint: str) -> dict | None:
    """A finished result with this fingerprint in `out_dir` (for --resume)."""
    if not Path(out_dir).exists():
        return None
    for doc in results.find_results(out_dir):
        if doc.get("fingerprint") == fingerprint:
            return doc
    return None


def run_configs(
    loaded: models.LoadedModel,
    inputs: Inputs,
    workload: Workload,
    protocol: Protocol,
    configs: list,
    *,
    env: dict,
    out_dir: Path,
    device: str = "cpu",
    resume: bool = False,
    reuse_baseline: bool = True,
    measure_ppl: bool = True,
    execute: bool = False,
    progress: Progress | None = None,
    prepare: Callable | None = None,
) -> tuple[dict, list[dict]]:
    """Baseline (measured or reused), then every config applied and measured against it.

    Each finished config is saved at once (atomically), so an interrupted sweep keeps its rows and
    `resume=True` skips them. `prepare(loaded, config)` defaults to the tuner registry's `apply`.
    Returns (baseline document, candidate documents in config order).
    """
    from infer_tune.tuners import apply as registry_apply

    prepare = prepare or registry_apply
    baseline, baseline_outputs, _ = ensure_baseline(loaded, inputs, workload, protocol, env=env, out_dir=out_dir,
                                                    device=device, reuse=reuse_baseline, measure_ppl=measure_ppl,
                                                    execute=execute, progress=progress)
    docs = []
    for config in configs:
        config_dict = config.to_dict()
        fp = run_fingerprint(loaded, config.technique, config_dict, workload, env, execute)
        if resume and (done := existing_result(out_dir, fp)) is not None:
            docs.append(done)
            continue
        prepared = prepare(loaded, config)
        prepared.device = device
        doc, outputs = measure_prepared(loaded, prepared, inputs, workload, protocol, technique=config.technique,
                                        config=config_dict, env=env, baseline=baseline,
                                        baseline_outputs=baseline_outputs, measure_ppl=measure_ppl,
                                        execute=execute, progress=progress)
        saved = results.save_run(out_dir, doc, outputs)
        doc["_path"] = str(saved.run_dir)
        docs.append(doc)
    return baseline, docs
