"""Benchmarks of a live OpenAI-compatible server: closed loop (`bench --endpoint`), one arrival trace,
a request-rate sweep with its saturation knee (`endpoint sim`), and a reference engine on loopback.

The result documents come from `sweep.measure_prepared` with the `endpoint` runner and are saved by
the engine's writer (`sweep.save_rows`: no weights here and no plain baseline, so not `run_configs`),
so they have
the keys of in-process runs: `technique: "endpoint"`, `runner: "endpoint"`, `config` the endpoint
(the name of the key's environment variable, never the key), `env.endpoint` what the server says
about itself. There are no weights in this process: `model_bytes`, `ppl`, the roofline and the
server's memory are null; `client_peak_rss_bytes` is this client's. docs/endpoint.md.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from infer_tune import results
from infer_tune.document import ResultDocument
from infer_tune.endpoint.arrivals import poisson_trace
from infer_tune.endpoint.config import EndpointConfig
from infer_tune.endpoint.probe import ServerInfo, connect
from infer_tune.endpoint.workloads import WorkloadOptions
from infer_tune.engines.base import ENDPOINT_ENGINE
from infer_tune.errors import ConfigError
from infer_tune.metrics import deltas, quality, saturation
from infer_tune.runners.base import Progress
from infer_tune.runners.endpoint import request_prompts
from infer_tune.runners.prepared import PreparedModel
from infer_tune.runners.trace import TraceRequest
from infer_tune.scenarios.common import RunSpec
from infer_tune.suites import Prompt
from infer_tune.sweep import Row, measure_prepared, save_rows
from infer_tune.workload import Inputs, Protocol, load_prompts, prepare_inputs

COMPARED_WORKLOAD_KEYS = ("suite", "limit", "seed", "max_new_tokens", "chat_template", "lang", "max_prompt_tokens",
                          "prompt_field", "reference_field")


@dataclass
class RemoteModel:
    """Stands in for a `LoadedModel` when the weights live in a server: a name, where it is served,
    and the local tokenizer when one was given (None: prompts go as chat messages, tokens are
    counted from the stream)."""

    ref: str
    path: str
    tokenizer: Any = None
    model: None = None
    dtype: str | None = None
    device: str = "endpoint"
    weights: None = None  # the server's own weights (never `--weights random`)


@dataclass
class EndpointRun:
    model: RemoteModel
    inputs: Inputs
    config: EndpointConfig
    info: ServerInfo
    env: dict
    # the served weights' bytes when known (a GGUF infer-tune started the server on): model_bytes and the
    # roofline (`roofline_fraction`) of its rows; None for a remote server
    weight_bytes: int | None = None
    conversations: list | None = None  # multi-turn: the suite's conversations (workloads.Conversation)


@dataclass
class SweepOutcome:
    docs: list[ResultDocument]
    knee_rate: float | None
    saturated: list[bool]
    knee_status: str  # within / beyond / below the swept rates (metrics.saturation.knee)
    run_dirs: list[Path] = field(default_factory=list)


def load_tokenizer(ref: str, trust_remote_code: bool = False):
    """The tokenizer of a model reference (checkpoint dir, alias, .gguf or hub id), without its weights."""
    from transformers import AutoTokenizer

    from infer_tune import models
    from infer_tune.errors import ModelError

    location = models.resolve(ref)
    try:
        return AutoTokenizer.from_pretrained(location, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as exc:
        raise ModelError(f"cannot load the tokenizer of {ref}: {str(exc).splitlines()[0]}") from None


def raw_inputs(spec: RunSpec, prompts) -> Inputs:
    """Without a tokenizer: the suite's first `limit` prompts as written (no chat template, no token cap)."""
    chosen = list(itertools.islice(prompts, spec.workload.limit)) if spec.workload.limit else list(prompts)
    if not chosen:
        raise ConfigError(f"suite '{spec.workload.suite}' has no prompts")
    return Inputs(prompts=chosen, rendered=[p.text for p in chosen], batches=[], templated=False)


def open_endpoint(spec: RunSpec, config: EndpointConfig, *, model_given: bool,
                  workload: WorkloadOptions | None = None) -> EndpointRun:
    """Suite first (bad suites fail fast), the local tokenizer when a model was named, then the endpoint:
    reached, asked what it serves and about itself, its request form settled. A multi-turn workload's
    suite is its conversations (their first turns are the run's inputs); a trace brings its own
    prompts (the handshake sends a fixed one)."""
    from infer_tune import env as envinfo

    kind = workload.kind if workload is not None else "poisson"
    conversations = None
    if kind == "multi-turn":
        conversations = suite_conversations(spec)
        prompts = [Prompt(id=c.id, text=c.users[0], reference=c.replies[0]) for c in conversations]
    elif kind == "trace":
        prompts = [Prompt(id="handshake", text="Hello")]
    else:
        prompts = load_prompts(spec.workload)
    tokenizer = load_tokenizer(spec.model, spec.trust_remote_code) if model_given else None
    if tokenizer is None and config.api == "completions" and spec.workload.chat_template:
        raise ConfigError("api 'completions' sends prompts rendered by the model's chat template: name the served "
                          "weights as model (for the tokenizer), or turn chat_template off")
    placeholder = RemoteModel(ref=spec.model, path="", tokenizer=tokenizer)
    inputs = prepare_inputs(placeholder, spec.workload, prompts) if tokenizer is not None else raw_inputs(spec, prompts)
    config, info = connect(config, request_prompts(inputs, config)[0])
    env = envinfo.collect_env(spec.threads)
    env["endpoint"] = info.to_env(config)
    model = RemoteModel(ref=spec.model if model_given else str(config.served_model),
                        path=f"{config.url}#{config.served_model}", tokenizer=tokenizer)
    return EndpointRun(model=model, inputs=inputs, config=config, info=info, env=env, conversations=conversations)


def suite_conversations(spec: RunSpec) -> list:
    """The suite's conversations (read before the endpoint is contacted: a suite without any fails first)."""
    from infer_tune.endpoint.workloads import conversations_of
    from infer_tune.suites import conversation_rows

    conversations = conversations_of(conversation_rows(spec.workload.suite_spec()))
    if not conversations:
        raise ConfigError(f"suite {spec.workload.suite} has no conversation with a human turn answered by gpt")
    return conversations


def subset_baseline(baseline: ResultDocument, baseline_outputs: list[dict],
                    outputs: list[dict]) -> tuple[ResultDocument, list[dict]]:
    """The baseline restricted to the prompts this run answered (failed requests leave gaps), with its
    BLEU / chrF recomputed on that subset so the drift compares the same prompts."""
    wanted = [o["prompt_id"] for o in outputs]
    by_id = {o["prompt_id"]: o for o in baseline_outputs}
    missing = [p for p in wanted if p not in by_id]
    if missing:
        raise ConfigError(f"baseline {baseline.run_id} has no output for prompt(s) {missing[:3]}; "
                          "measure it on the same workload")
    subset = [by_id[p] for p in wanted]
    if len(subset) == len(baseline_outputs):
        return baseline, subset
    scores = quality.reference_scores([o["output"] for o in subset], [o.get("reference") for o in subset])
    return dataclasses.replace(baseline, metrics={**baseline.metrics, **scores}), subset  # in memory, never saved


def check_baseline(baseline: ResultDocument, workload) -> None:
    theirs, ours = baseline.workload, workload.to_dict()
    for key in COMPARED_WORKLOAD_KEYS:
        if theirs.get(key) != ours.get(key):
            raise ConfigError(f"baseline {baseline.run_id} measured another workload: {key} "
                              f"{theirs.get(key)!r} vs {ours.get(key)!r} here")


def measure_endpoint(run: EndpointRun, spec: RunSpec, *, trace: list[TraceRequest] | None = None,
                     protocol: Protocol | None = None, baseline: tuple[ResultDocument, list[dict]] | None = None,
                     slo: dict[str, float] | None = None, extra_config: dict | None = None,
                     label_suffix: str = "", progress: Progress | None = None, engine: str = ENDPOINT_ENGINE,
                     engine_argv: list[str] | None = None,
                     material: Material | None = None) -> tuple[ResultDocument, list[dict]]:
    """One result document of the endpoint (closed loop, or one replay of `trace`), optionally against a
    baseline; with `slo`, goodput and SLO attainment (metrics.saturation); `material`: a workload's own
    requests (prompts, sessions) in place of the suite's. `engine`: the registered engine behind it (a server
    measured as it runs, unless infer-tune launched it: then its argv too)."""
    config = run.config
    options = {"endpoint": config, "trace": trace, "slo": slo}
    if material is not None:
        options.update(material.runner_options)
    prepared = PreparedModel(model=None, tokenizer=run.model.tokenizer, label=config.display_label() + label_suffix,
                             device="endpoint", metrics={"model_bytes": run.weight_bytes},
                             extra_model_bytes=run.weight_bytes or 0, runner_options=options)
    config_dict = {**config.to_dict(), **(extra_config or {})}
    inputs = material.inputs if material is not None else run.inputs
    doc, outputs = measure_prepared(run.model, prepared, inputs, spec.workload, protocol or spec.protocol,
                                    technique="endpoint", config=config_dict, env=run.env, runner="endpoint",
                                    measure_ppl=False, execute=spec.execute, progress=progress, engine=engine,
                                    engine_argv=engine_argv)
    doc.model.update(model_bytes=run.weight_bytes, served_model=config.served_model, tokenizer=run.model.tokenizer is not None)
    if baseline is not None:
        base_doc, base_outputs = subset_baseline(baseline[0], baseline[1], outputs)
        doc.add_metrics(deltas.versus_baseline(doc.metrics, outputs, base_doc, base_outputs),
                        source="the deltas against the baseline file")
        doc.baseline_run_id = baseline[0].run_id
    return doc, outputs


def load_baseline(path: Path | None, spec: RunSpec, model_given: bool) -> tuple[ResultDocument, list[dict]] | None:
    """The baseline document and outputs, checked against the workload (before the endpoint is contacted)."""
    if path is None:
        return None
    if not model_given:
        raise ConfigError("drift against a baseline compares token sequences: name the served weights as model "
                          "(their tokenizer)")
    doc = results.load_result(path)
    check_baseline(doc, spec.workload)
    return doc, results.load_outputs(doc)


def run_endpoint_bench(spec: RunSpec, config: EndpointConfig, *, model_given: bool, baseline: Path | None = None,
                       launched: dict | None = None, progress: Progress | None = None) -> ResultDocument:
    """`bench --endpoint`: closed-loop passes per the protocol; the saved document (its `location` set).
    `launched`: how infer-tune started the server itself (a reference engine), recorded in `env.endpoint`."""
    reference = load_baseline(baseline, spec, model_given)
    run = open_endpoint(spec, config, model_given=model_given)
    if launched:
        run.env["endpoint"]["launched"] = launched
        run.weight_bytes = launched.get("weight_bytes")
    extra = {"engine": launched["engine"], "continuous_batching": launched["continuous_batching"]} if launched else None
    doc, outputs = measure_endpoint(run, spec, baseline=reference, extra_config=extra, progress=progress)
    return save_rows(spec.out_dir, [Row(doc, outputs)])[0]


def run_endpoint_trace(spec: RunSpec, config: EndpointConfig, trace: list[TraceRequest], *, model_given: bool,
                       slo: dict[str, float] | None = None, trace_info: dict | None = None,
                       progress: Progress | None = None) -> ResultDocument:
    """One open-loop replay of `trace` (e.g. `batch serve-sim --endpoint`), saved; goodput under `slo`."""
    run = open_endpoint(spec, config, model_given=model_given)
    doc, outputs = trace_document(run, spec, trace, slo or {}, trace_info or {}, progress)
    return save_rows(spec.out_dir, [Row(doc, outputs)])[0]


def trace_document(run: EndpointRun, spec: RunSpec, trace: list[TraceRequest] | None, slo: dict[str, float],
                   trace_info: dict, progress: Progress | None,
                   material: Material | None = None) -> tuple[ResultDocument, list[dict]]:
    protocol = Protocol(warmup=spec.protocol.warmup, min_iterations=1, min_duration_s=0.0)
    rate = trace_info.get("rate_req_s", "")
    suffix = "" if "rate_req_s" not in trace_info else f" @{'inf' if rate is None else format(rate, 'g')}rps"
    extra = {"trace": {**trace_info, "requests": len(trace) if trace is not None else len(material.inputs.prompts)},
             "slo": dict(slo)}
    if material is not None:
        extra["workload"] = material.info
        suffix = f" {material.info['kind']}" + suffix
    return measure_endpoint(run, spec, trace=trace, protocol=protocol, slo=slo, extra_config=extra,
                            label_suffix=suffix, progress=progress, material=material)


@dataclass
class Material:
    """A workload's requests for one replay: the runner's options (`prompts` per request index, or
    `sessions`), the inputs the outputs are matched to, what the result records (`info`, in
    `config.workload`) and the files saved beside it (the schedule, to replay it exactly)."""

    inputs: Inputs
    runner_options: dict
    info: dict
    files: dict[str, bytes] = field(default_factory=dict)


def render_for(run: EndpointRun, spec: RunSpec):
    """What a list of chat messages becomes under the completions API: the tokenizer's chat template
    (when the workload renders one), else the contents one per paragraph; None under the chat API."""
    from infer_tune.endpoint.replay import prompt_text

    tokenizer = run.model.tokenizer
    if run.config.api == "chat":
        return None
    if tokenizer is not None and spec.workload.chat_template and getattr(tokenizer, "chat_template", None):
        return lambda messages: tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return prompt_text


def schedule_jsonl(trace: list[TraceRequest], prompts: list, max_new_tokens: int) -> bytes:
    """The replayed requests as a plain JSONL trace (timestamp ms, prompt or messages, output_length):
    `--workload trace --trace-format jsonl --trace schedule.jsonl` sends them again, at the same times."""
    from infer_tune.endpoint.workloads import TraceEntry, trace_jsonl

    entries = [TraceEntry(r.arrival_s, 0, r.max_new_tokens or max_new_tokens, prompt=prompts[r.prompt_index])
               for r in trace]
    return "".join(line.replace('"input_length": 0, ', "") for line in trace_jsonl(entries).splitlines(True)).encode()


def shared_prefix_material(run: EndpointRun, spec: RunSpec, workload: WorkloadOptions, trace: list[TraceRequest],
                           vocab: list[str]) -> tuple[list[TraceRequest], Material]:
    """Request k: one of `prefixes` system prompts of `prefix_tokens` words (seeded), then suite prompt k
    mod n as the user's message."""
    from infer_tune.endpoint.replay import prompt_text
    from infer_tune.endpoint.workloads import shared_prefix_requests

    n = len(trace)
    texts, choice, suite_index = shared_prefix_requests(n, len(run.inputs.prompts), prefixes=workload.prefixes,
                                                        prefix_tokens=workload.prefix_tokens,
                                                        seed=spec.workload.seed, vocab=vocab)
    render = render_for(run, spec)
    messages = [[{"role": "system", "content": texts[choice[k]]},
                 {"role": "user", "content": run.inputs.prompts[suite_index[k]].text}] for k in range(n)]
    prompts = [m if render is None else render(m) for m in messages]
    inputs = Inputs(prompts=[Prompt(id=f"{run.inputs.prompts[suite_index[k]].id}#prefix{choice[k]}",
                                    text=prompt_text(messages[k]), reference=run.inputs.prompts[suite_index[k]].reference)
                             for k in range(n)], rendered=[], batches=[], templated=False)
    trace = [TraceRequest(k, r.arrival_s, r.max_new_tokens) for k, r in enumerate(trace)]
    info = {**workload.to_dict(), "seed": spec.workload.seed, "prefix_of_request": choice,
            "requests_per_prefix": [choice.count(i) for i in range(workload.prefixes)]}
    files = {"schedule.jsonl": schedule_jsonl(trace, prompts, spec.workload.max_new_tokens)}
    return trace, Material(inputs, {"prompts": prompts}, info, files)


def multi_turn_material(run: EndpointRun, spec: RunSpec, workload: WorkloadOptions,
                        arrivals: list[float]) -> Material:
    """Session k: conversation k (of the suite's, seeded order) arriving at `arrivals[k]`; every user turn
    is a prompt of the result (its reference: the recorded reply)."""
    from infer_tune.endpoint.workloads import plan_sessions

    plans = plan_sessions(run.conversations, arrivals, max_turns=workload.max_turns, think_time_ms=workload.think_time_ms,
                          seed=spec.workload.seed, min_turns=workload.min_turns)
    prompts = [Prompt(id=f"{p.conversation.id}#turn{k + 1}", text=user, reference=p.conversation.replies[k])
               for p in plans for k, user in enumerate(p.conversation.users)]
    inputs = Inputs(prompts=prompts, rendered=[], batches=[], templated=False)
    options = {"sessions": plans, "history": workload.history, "render": render_for(run, spec),
               "prompts": [p.text for p in prompts]}
    info = {**workload.to_dict(), "seed": spec.workload.seed, "turns_planned": len(prompts)}
    files = {"sessions.jsonl": "".join(json.dumps(p.to_dict(), ensure_ascii=False) + "\n" for p in plans).encode()}
    return Material(inputs, options, info, files)


def load_trace(spec: RunSpec, workload: WorkloadOptions, requests: int | None) -> tuple[list, dict]:
    """The trace file's requests (the first `requests`, or a synthesized trace of `requests` with its
    statistics when that is more than it has), arrivals scaled by `time_scale`; and what was read."""
    from infer_tune.endpoint import workloads as wl

    entries, read = wl.read_trace(workload.trace, workload.trace_format, block_size=workload.block_size)
    synthesized = requests is not None and requests > len(entries)
    if synthesized:
        entries = wl.synthesize_trace(entries, requests, seed=spec.workload.seed)
    elif requests is not None:
        entries = entries[:requests]
    return wl.scale_times(entries, workload.time_scale), {**read, "synthesized": synthesized}


def trace_material(run: EndpointRun, spec: RunSpec, workload: WorkloadOptions, entries: list,
                   read: dict) -> tuple[list[TraceRequest], Material]:
    """The trace's requests with their prompts (Mooncake hash blocks as shared words, see workloads)."""
    from infer_tune.endpoint import workloads as wl
    from infer_tune.endpoint.replay import prompt_text

    prompts = wl.trace_prompts(entries, seed=spec.workload.seed, block_size=workload.block_size,
                               vocab=wl.vocabulary(run.model.tokenizer))
    render = render_for(run, spec)
    sent = [p if render is None or isinstance(p, str) else render(p) for p in prompts]
    inputs = Inputs(prompts=[Prompt(id=f"request{k}", text=prompt_text(p)) for k, p in enumerate(prompts)],
                    rendered=[], batches=[], templated=False)
    trace = [TraceRequest(k, e.arrival_s, e.output_length) for k, e in enumerate(entries)]
    info = {**workload.to_dict(), "seed": spec.workload.seed, **read,
            "requests": len(entries), "span_s": entries[-1].arrival_s,
            "requests_sharing_first_block": wl.sharing_first_block(entries)}
    files = {"schedule.jsonl": schedule_jsonl(trace, sent, spec.workload.max_new_tokens)}
    return trace, Material(inputs, {"prompts": sent}, info, files)


def run_endpoint_workload(spec: RunSpec, config: EndpointConfig, workload: WorkloadOptions, *, model_given: bool,
                          requests: int | None = None, slo: dict[str, float] | None = None,
                          progress: Progress | None = None) -> ResultDocument:
    """One replay of a timed trace file (`--workload trace`), or of a multi-turn / shared-prefix workload
    with everything arriving at once (`bench --endpoint --workload ...`: at most `concurrency` in flight);
    saved with its schedule."""
    loaded = load_trace(spec, workload, requests) if workload.kind == "trace" else None  # a bad file fails first
    run = open_endpoint(spec, config, model_given=model_given, workload=workload)
    if loaded is not None:
        trace, material = trace_material(run, spec, workload, *loaded)
        info = {"time_scale": workload.time_scale, "seed": spec.workload.seed}
    else:
        trace, material = workload_material(run, spec, workload, math.inf, requests or len(run.inputs.prompts), 1.0)
        info = {"rate_req_s": None, "seed": spec.workload.seed}
    doc, outputs = trace_document(run, spec, trace, slo or {}, info, progress, material)
    return save_rows(spec.out_dir, [Row(doc, outputs, material.files)])[0]


def workload_material(run: EndpointRun, spec: RunSpec, workload: WorkloadOptions, rate: float, requests: int,
                      burstiness: float) -> tuple[list[TraceRequest] | None, Material | None]:
    """One rate's requests: the seeded arrival process gives sessions (multi-turn) or requests."""
    from infer_tune.endpoint.workloads import vocabulary

    if workload.kind == "multi-turn":
        arrivals = [r.arrival_s for r in poisson_trace(workload.sessions, rate, 1, seed=spec.workload.seed,
                                                       burstiness=burstiness)]
        return None, multi_turn_material(run, spec, workload, arrivals)
    trace = poisson_trace(requests, rate, len(run.inputs.prompts), seed=spec.workload.seed, burstiness=burstiness)
    if workload.kind == "shared-prefix":
        return shared_prefix_material(run, spec, workload, trace, vocabulary(run.model.tokenizer))
    return trace, None


def run_endpoint_sweep(spec: RunSpec, config: EndpointConfig, rates: list[float], *, requests: int,
                       model_given: bool, burstiness: float = 1.0, slo: dict[str, float] | None = None,
                       knee_factor: float = 2.0, progress: Progress | None = None,
                       workload: WorkloadOptions | None = None) -> SweepOutcome:
    """`endpoint sim`: one seeded arrival trace per rate (same seed, same prompts), each replayed once;
    then the knee marked on every document and a rates plot saved beside each. `workload`: what arrives
    (multi-turn: sessions at the rate; shared-prefix: requests with shared system prompts)."""
    workload = workload or WorkloadOptions()
    run = open_endpoint(spec, config, model_given=model_given, workload=workload)
    measured, files = [], []
    for rate in sorted(rates):
        trace, material = workload_material(run, spec, workload, rate, requests, burstiness)
        info = {"rate_req_s": None if math.isinf(rate) else rate, "burstiness": burstiness, "seed": spec.workload.seed}
        measured.append(trace_document(run, spec, trace, slo or {}, info, progress, material))
        files.append(material.files if material is not None else {})
    knee_rate, saturated, status = saturation.knee(
        sorted(rates), [d.ttft_p50_ms for d, _ in measured],
        [d.metric("request_throughput_req_s") for d, _ in measured], knee_factor)
    png = rates_png([d for d, _ in measured], sorted(rates), knee_rate, f"{config.display_label()}: rate sweep")
    for rate, flag, (doc, _) in zip(sorted(rates), saturated, measured):
        doc.add_metrics({"offered_rate_req_s": None if math.isinf(rate) else rate, "saturated": flag,
                         "knee_rate_req_s": knee_rate, "knee_status": status, "knee_factor": knee_factor,
                         "sweep_rates": [None if math.isinf(r) else r for r in sorted(rates)]}, source="the rate sweep",
                        namespace="sweep")
    docs = save_rows(spec.out_dir, [Row(doc, outputs, {"rates.png": png, **extra})
                                    for (doc, outputs), extra in zip(measured, files)])
    return SweepOutcome(docs=docs, knee_rate=knee_rate, saturated=saturated, knee_status=status,
                        run_dirs=[Path(d.location) for d in docs])


def rates_png(docs: list[ResultDocument], rates: list[float], knee_rate: float | None, title: str) -> bytes:
    """Output tokens/s and TTFT p50 / p99 against the offered rate, the knee marked."""
    from infer_tune.report.plots import png_bytes, pyplot

    plt = pyplot()
    xs = [r if not math.isinf(r) else max([x for x in rates if not math.isinf(x)] or [1.0]) * 2 for r in rates]
    fig, left = plt.subplots(figsize=(7, 4))
    left.plot(xs, [d.throughput_tok_s for d in docs], "o-", label="output tok/s")
    left.set_xlabel("offered rate (requests/s)")
    left.set_ylabel("output tokens/s")
    right = left.twinx()
    for stat, style in (("p50", "s--"), ("p99", "^:")):
        right.plot(xs, [d.stat("ttft_ms", stat) for d in docs], style, color="tab:red", label=f"TTFT {stat}")
    right.set_ylabel("TTFT (ms)")
    if knee_rate is not None:
        left.axvline(knee_rate, color="gray", linestyle="-.", label=f"knee {knee_rate:g} req/s")
    handles = left.get_legend_handles_labels()[0] + right.get_legend_handles_labels()[0]
    left.legend(handles=handles, fontsize=7, loc="upper left")
    left.set_title(title)
    left.grid(True, alpha=0.3)
    return png_bytes(fig)


def served_weight_bytes(server) -> int | None:
    """Bytes of the GGUF a started server reads (its weights, as stored: llama.cpp's `--model` file); None for a
    server that was given no GGUF."""
    if "--model" not in server.command:
        return None
    path = Path(server.command[server.command.index("--model") + 1])
    return path.stat().st_size if path.suffix.lower() == ".gguf" and path.is_file() else None


def run_reference(spec: RunSpec, engine: str, config: EndpointConfig, *, continuous_batching: bool = False,
                  extra_args: list[str] | None = None, startup_timeout_s: float = 300.0, parallel: int = 1,
                  progress: Progress | None = None) -> ResultDocument:
    """Start a reference engine on loopback with `spec.model`'s weights, bench it like any endpoint, stop it.
    `parallel`: llama.cpp's server slots (the client keeps at least that many requests in flight)."""
    from infer_tune.endpoint.servers import local_server

    with local_server(engine, spec.model, continuous_batching=continuous_batching, threads=spec.threads,
                      startup_timeout_s=startup_timeout_s, parallel=parallel, extra_args=extra_args or ()) as server:
        config = dataclasses.replace(config, url=server.url, served_model=server.served_model,
                                     label=config.label or (engine if parallel == 1 else f"{engine} x{parallel}"),
                                     concurrency=max(config.concurrency, parallel))
        launched = {"engine": engine, "continuous_batching": continuous_batching or parallel > 1,
                    "parallel": parallel, "command": server.command, "weight_bytes": served_weight_bytes(server)}
        doc = run_endpoint_bench(spec, config, model_given=True, launched=launched, progress=progress)
    return doc
