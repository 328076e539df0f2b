"""A measured run turned into its result document: the timing figures, memory, roofline, quality and the
deltas against the baseline (`build_document`), and what makes two runs the same measurement
(`run_fingerprint`); docs/architecture.md, "Result documents"."""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass

from infer_tune import env as envinfo
from infer_tune import models, results, suites
from infer_tune.document import ResultDocument, merge_facts, row_namespaces
from infer_tune.engines.base import DEFAULT_ENGINE, ENGINES
from infer_tune.errors import ConfigError
from infer_tune.metrics import deltas, kv, noise, quality, roofline
from infer_tune.metrics.perplexity import reference_perplexity
from infer_tune.metrics.schema import check_declared
from infer_tune.metrics.stats import summarize
from infer_tune.runners import GenerationRun, PreparedModel
from infer_tune.workload import Inputs, Protocol, Workload, workload_block


def run_fingerprint(loaded: models.LoadedModel, technique: str, config: dict, workload: Workload, env: dict,
                    execute: bool | str = False, *, protocol: Protocol | None = None, measure_ppl: bool = True) -> str:
    """What makes two runs the same measurement: the model's bytes (weights, config, tokenizer) and the
    suite's, dtype, device, technique, config, workload, protocol, what is measured, threads, machine,
    and the tool's version. Paths are left out: the same bytes elsewhere are the same measurement."""
    work = workload.to_dict()
    work["suite"] = suites.content_id(workload.suite)
    return results.fingerprint(models.content_id(loaded), loaded.dtype, loaded.device, technique, config, work,
                               asdict(protocol) if protocol else None, measure_ppl, env["threads"], env["machine"],
                               execute, envinfo.tool_info()["version"])


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
               "prompt_index": [r.prompt_index for r in timed], "output_tokens": [len(r.token_ns) for r in timed]}
    if any(r.start_ns is not None for r in timed):  # a scheduler queued requests
        queue = [r.queue_ms for r in timed]
        metrics["queue_ms"] = summarize(queue)
        samples["queue_ms"] = queue
    return metrics, samples


def kv_bytes_read(prepared: PreparedModel, mean_context: float, batch_size: int) -> float:
    """KV-cache bytes a decode step reads at `mean_context` tokens, at the cache's real width
    (the technique's `kv_bits` when it sets one, else the model's floating dtype)."""
    model = prepared.model
    if model is None or "kv_bits" in prepared.metrics and prepared.metrics["kv_bits"] is None:
        return 0.0
    try:
        shape = kv.ModelShape.from_config(model.config)
    except (ConfigError, AttributeError):
        return 0.0
    bits = prepared.metrics.get("kv_bits") or next(
        (p.element_size() * 8 for p in model.parameters() if p.is_floating_point()), 32)
    return float(kv.kv_bytes(shape, 1, bits)) * mean_context * batch_size


@dataclass
class Measured:
    """What one measurement ran and what it gave: the first input of `build_document`."""

    loaded: models.LoadedModel  # the source model (its ref, parameters, content id)
    prepared: PreparedModel  # what ran (its weights' bytes, facts, label)
    run: GenerationRun  # the runner's raw timings, outputs, memory readings and counters
    inputs: Inputs
    workload: Workload
    protocol: Protocol
    host: tuple[noise.HostSnapshot, noise.HostSnapshot]  # the host before and after (metrics.noise)
    rounds_block: dict | None = None  # `metrics.rounds` of a run measured in interleaved rounds
    ratios: dict[str, dict | None] | None = None  # its per-round ratio intervals: name -> log_ratio_interval


@dataclass
class RowSpec:
    """What the row is and what it is compared with: the second input of `build_document`."""

    technique: str
    config: dict
    runner: str
    env: dict
    measure_ppl: bool = True
    execute: bool | str = False  # True: the code suite's tests run on the outputs in the sandbox; "unsafe": not
    baseline: ResultDocument | None = None
    baseline_outputs: list[dict] | None = None
    engine: str | None = None  # the registered engine that ran it (None: engines.base.DEFAULT_ENGINE)
    engine_argv: list[str] | None = None  # its command line, when it was launched as a server here


def roofline_ceiling(rounds_block: dict | None, prepared: PreparedModel, env: dict) -> tuple[float, str]:
    """(GB/s, where it came from) of a row's roofline ceiling: the median of the rounds' reads of its weights (each
    the mean of reads taken right after each of the row's runs: the same seconds as its decode); weights on an
    accelerator: a read of that device's own memory (env.device_read_gb_s); a single pass: a read of its weights
    right after the run; no weights here: the host's cached reading."""
    reads = [r for r in (rounds_block or {}).get("read_gb_s_by_round") or [] if r]
    device = str(prepared.device or "cpu")
    if reads:
        return statistics.median(reads), "read of the weights in the rounds"
    if prepared.model is not None and not device.startswith(("cpu", "meta")):
        return envinfo.device_read_gb_s(device), f"read of {device} memory"
    # a single pass: a plain read of the same bytes, right after the run, on the same threads. The host's cached
    # reading (a 256 MiB copy, possibly minutes old) is the wrong ceiling where the weights fit a large L3
    # (the decode then reads from cache) or the memory's speed has moved since: it gave fractions above 1
    tensors = models.readable_tensors(prepared.model) if prepared.model is not None else []
    read = envinfo.read_gb_s(tensors) if tensors else None
    if read:
        return read, "read of the weights after the run"
    return env["mem_bandwidth_gb_s"], "host reading"


def build_document(measured: Measured, row: RowSpec) -> tuple[ResultDocument, list[dict]]:
    """The result document and outputs rows of one measured run.

    `row.execute=True` also runs the code suite's tests on the outputs (pass@1) in the OS sandbox
    (metrics/sandbox.py); `execute="unsafe"` runs them without it (only where the user allowed that).
    A run measured in rounds passes its `metrics.rounds` block and its per-round ratio intervals
    (`measured.ratios`), which replace the pooled point ratios.
    """
    loaded, prepared, run, inputs = measured.loaded, measured.prepared, measured.run, measured.inputs
    workload, protocol, rounds_block, ratios = measured.workload, measured.protocol, measured.rounds_block, measured.ratios
    technique, config, env, runner = row.technique, row.config, row.env, row.runner
    baseline, baseline_outputs, measure_ppl, execute = row.baseline, row.baseline_outputs, row.measure_ppl, row.execute
    metrics, samples = timing_metrics(run)
    if rounds_block is not None:
        metrics["rounds"] = rounds_block
    metrics["noise"] = noise.figure(run.requests, *measured.host, rounds=rounds_block)
    weight_bytes = (models.model_bytes(prepared.model) if prepared.model is not None else 0) \
        + prepared.extra_model_bytes
    mean_context = (sum(o.prompt_tokens for o in run.outputs) / max(len(run.outputs), 1)
                    + workload.max_new_tokens / 2)
    kv_read = kv_bytes_read(prepared, mean_context, run.batch_size)
    bandwidth, source = roofline_ceiling(rounds_block, prepared, env)
    # a speculative pass reads the weights once for every token it verifies: the ceiling is per pass, not per token
    per_pass = run.counters.get("tokens_per_target_pass")
    per_pass = per_pass if isinstance(per_pass, (int, float)) and per_pass > 1 else 1.0
    metrics.update(roofline.roofline(bandwidth, weight_bytes, kv_read, max(run.batch_size, 1),
                                     metrics["tpot_ms"]["p50"], tokens_per_pass=per_pass))
    metrics["roofline_bandwidth_gb_s"] = bandwidth
    metrics["roofline_bandwidth_from"] = source
    if rounds_block is not None:  # each round's decode against the read taken after it
        paired = roofline.by_round(rounds_block.get("read_gb_s_by_round") or [],
                                   (rounds_block.get("per_round") or {}).get("tpot_ms") or [],
                                   weight_bytes + kv_read, max(run.batch_size, 1), tokens_per_pass=per_pass)
        if paired is not None:
            metrics.update(paired)
    metrics.update({
        "peak_rss_bytes": run.peak_rss_bytes,
        "rss_before_bytes": run.rss_before_bytes,
        "peak_rss_delta_bytes": run.peak_rss_bytes - run.rss_before_bytes
        if run.peak_rss_bytes is not None and run.rss_before_bytes is not None else None,
        "cuda_peak_bytes": run.cuda_peak_bytes,
        # no weights in this process and none declared (an endpoint whose served bytes are unknown): unknown
        "model_bytes": weight_bytes if prepared.model is not None or prepared.extra_model_bytes else None,
        "first_call_ms": run.first_call_ms,
        "warmup_s": run.warmup_s,
        "iterations": run.iterations,
        "generated_tokens": run.generated_tokens,
    })
    if prepared.extra_model_bytes:
        metrics["extra_model_bytes"] = prepared.extra_model_bytes
    texts = [o.text for o in run.outputs]
    references = [inputs.prompts[o.prompt_index].reference for o in run.outputs]
    random_weights = loaded.weights is not None  # no quality to measure: outputs of random weights mean nothing
    metrics.update(quality.reference_scores(texts, references))
    metrics["ppl"] = (reference_perplexity(prepared.model, prepared.tokenizer, inputs.rendered,
                                           [p.reference for p in inputs.prompts], device=prepared.device,
                                           scorer=prepared.scorer)
                      if measure_ppl and prepared.model is not None and not random_weights else None)
    if execute and not random_weights:
        from infer_tune.metrics import passk
        from infer_tune.metrics.passk import pass_at_1

        isolation = "unsafe" if execute == "unsafe" else "sandbox"
        metrics["pass_at_1"] = pass_at_1([inputs.prompts[o.prompt_index] for o in run.outputs], texts,
                                         isolation=isolation)
        metrics["pass_at_1_isolation"] = isolation
        metrics["pass_at_1_memory_limit"] = passk.memory_limit(isolation)
    # the technique's facts and counters beside the measured figures, never over them (OverwriteError), each
    # key declared by the row's technique or engine (metrics/schema.py)
    spaces = row_namespaces(technique, config, row.engine or DEFAULT_ENGINE)
    check_declared(prepared.metrics, spaces, f"{technique}'s prepared facts")
    merge_facts(metrics, prepared.metrics, f"{technique}'s prepared facts")
    check_declared(run.counters, spaces, f"{technique}'s counters")
    merge_facts(metrics, run.counters, f"{technique}'s counters")
    if run.ranks:
        metrics["ranks"] = run.ranks
    outputs = [{"prompt_id": inputs.prompts[o.prompt_index].id, "prompt": inputs.prompts[o.prompt_index].text,
                "output": o.text, "token_ids": o.token_ids, "prompt_tokens": o.prompt_tokens,
                "hit_eos": o.hit_eos, "reference": inputs.prompts[o.prompt_index].reference}
               for o in run.outputs]
    if baseline is not None and baseline_outputs is not None:
        # a runner's own `output_mismatches` (a batch scheduler's count against single-request greedy on its
        # own weights, docs/batch.md) is what the row claims; the count against the baseline's outputs (another
        # model when the row quantizes) is kept beside it as `output_mismatches_vs_baseline`
        own = run.counters.get("output_mismatches")
        metrics.update(deltas.versus_baseline(metrics, outputs, baseline, baseline_outputs))
        if own is not None and "output_mismatches" in metrics:
            metrics["output_mismatches_vs_baseline"] = metrics["output_mismatches"]
            metrics["output_mismatches"] = own
        for name, interval in (ratios or {}).items():
            if interval is not None:  # the rounds' geometric mean: the figure its interval is about
                metrics[name] = interval["point"]
                metrics[f"{name}_ci95"] = interval["ci95"]
    if random_weights:
        quality_not_applicable(metrics)
    result = ResultDocument(
        run_id=results.new_run_id(technique, prepared.label),
        created_at=results.created_stamp(),
        tool=envinfo.tool_info(),
        env=env,
        # params: the logical parameter count of the source model (a quantized copy stores fewer
        # nn.Parameters); model_bytes: what the prepared model really stores (+ a draft's weights)
        model={"ref": loaded.ref, "path": loaded.path,
               "params": models.count_params(loaded.model) if loaded.model is not None else None,
               "model_bytes": weight_bytes, "dtype": loaded.dtype,
               "content_id": models.content_id(loaded) if loaded.model is not None else None,
               **({"weights": "pretrained"} if loaded.weights is None else loaded.weights.describe())},
        technique=technique,
        label=prepared.label,
        config=config,
        runner=runner,
        workload={**workload_block(workload, inputs), "suite_id": suites.content_id(workload.suite)},
        protocol=asdict(protocol),
        metrics=metrics,
        samples=samples,
        baseline_run_id=baseline["run_id"] if baseline else None,
        fingerprint=run_fingerprint(loaded, technique, config, workload, env, execute, protocol=protocol,
                                    measure_ppl=measure_ppl),
    )
    engine = row.engine or DEFAULT_ENGINE
    entry = ENGINES.get(engine)
    result.set_engine(engine, entry.identity() if entry is not None else {}, row.engine_argv)
    return result, outputs


# quality figures that mean nothing on random weights (docs/metrics.md, "Random weights")
QUALITY_KEYS = ("bleu", "chrf", "ppl", "pass_at_1", "pass_at_1_isolation", "bleu_drift", "bleu_drift_ci95",
                "ppl_delta_pct", "pass_at_1_delta", "bleu_vs_baseline", "exact_match_vs_baseline")


def quality_not_applicable(metrics: dict) -> None:
    """A random-weight row: every quality figure null, `quality` says why, and no broken verdict (it rests on
    quality alone). Token-level agreement with the baseline (`output_mismatches`) stays: it is not quality."""
    from infer_tune.weights import QUALITY_NA

    for key in QUALITY_KEYS:
        if key in metrics:
            metrics[key] = None
    metrics["quality"] = QUALITY_NA
    if "broken" in metrics:
        metrics.update(broken=False, broken_why=None, verdict_evidence=QUALITY_NA)
