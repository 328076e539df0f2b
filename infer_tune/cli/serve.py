"""`infer-tune serve`: a recipe's configuration (or a model and a quantization method) behind an
OpenAI-compatible HTTP server on loopback (docs/endpoint.md, "Serving")."""

from __future__ import annotations

from typing import Annotated

import typer

from infer_tune.cli import options as opt
from infer_tune.cli import output
from infer_tune.errors import ConfigError


def serve(
    recipe: Annotated[str | None, typer.Option("--recipe", "-r", help="Recipe or recommended.yaml whose config to serve.")] = None,
    config_index: Annotated[int | None, typer.Option("--config", help="Which of the recipe's configs (0-based), when it has several.")] = None,
    model: Annotated[str | None, typer.Option("--model", "-m", help="The model (with --method; with --recipe it replaces the recipe's).")] = None,
    method: Annotated[str | None, typer.Option("--method", help="Quantization method without a recipe (bf16, int8-dynamic, int4-rtn, ...).")] = None,
    activations: Annotated[str, typer.Option("--activations", help="With --method int4-*: bf16 or int8 (the w4a8 kernels).")] = "bf16",
    slots: Annotated[int | None, typer.Option("--slots", help="Requests decoded together (default: the config's batch size; 1 for a lean config; else 4).")] = None,
    native_step: Annotated[bool | None, typer.Option("--native-step/--no-native-step", help="The decode step in one native call (int4 a8 Llama models).")] = None,
    compile: Annotated[bool | None, typer.Option("--compile/--no-compile", help="Compile the batched decode step (default on; the native step needs none).")] = None,
    context: Annotated[int | None, typer.Option("--context", help="Cache positions per slot (prompt + output; default min(2048, the model's)).")] = None,
    host: Annotated[str, typer.Option("--host", help="Address to listen on (loopback by default; beyond it, give --api-key-env).")] = "127.0.0.1",
    port: Annotated[int, typer.Option("--port", help="Port (0: a free one, printed when ready).")] = 8000,
    max_waiting: Annotated[int, typer.Option("--max-waiting", help="Requests that may wait for a slot; more get HTTP 503 (Retry-After).")] = 256,
    api_key_env: Annotated[str | None, typer.Option("--api-key-env", help="Environment variable holding the API key every /v1 request must send (Authorization: Bearer KEY).")] = None,
    prefill_chunk: Annotated[int, typer.Option("--prefill-chunk", help="With the native step: prompt tokens one step runs at most beside the decoding slots' tokens.")] = 128,
    speculate: Annotated[int | None, typer.Option("--speculate", help="Prompt-lookup draft tokens per step, verified in the native step (greedy: the same text; 0: off; default: the config's).")] = None,
    ngram: Annotated[int | None, typer.Option("--ngram", help="With --speculate: the longest n-gram prompt lookup matches.")] = None,
    prefix_cache: Annotated[bool, typer.Option("--prefix-cache/--no-prefix-cache", help="With the native step: a prompt that begins like one served before skips the prefill of what they share (a chat's history, a system prompt).")] = True,
    cache_mib: Annotated[float, typer.Option("--cache-mib", help="Host memory for prefixes evicted from the slots (the prefix cache's store, LRU); 0 keeps only what the slots hold.")] = 1024.0,
    kv_cache: Annotated[str | None, typer.Option("--kv-cache", help="The native step's KV cache: fp32, or int8 (one fp32 scale per vector of a head: a quarter of the bytes, so long chats fit; default: the config's).")] = None,
    threads: opt.Threads = None,
    debug: opt.Debug = False,
) -> None:
    """Serve a configuration over HTTP (OpenAI-compatible: /v1/chat/completions, /v1/completions, streaming,
    usage; /v1/models, /health, /metrics) with the slot engine; stops cleanly on Ctrl-C or SIGTERM.

    Example: infer-tune serve --recipe runs/x/recommended.yaml --port 8000
    Example: infer-tune serve --model smollm2-135m --method int4-rtn --activations int8 --native-step --slots 4
    Example: infer-tune serve --model smollm2-135m --method int4-rtn --activations int8 --speculate 8
    Example: infer-tune serve --model smollm2-135m --method int4-rtn --activations int8 --kv-cache int8
    Example: SERVE_KEY=... infer-tune serve --recipe recommended.yaml --host 0.0.0.0 --api-key-env SERVE_KEY
    """
    import os

    from infer_tune.endpoint.serving import is_loopback, listen
    from infer_tune.scenarios import serve as scenario

    if (recipe is None) == (method is None):
        raise ConfigError("give --recipe (a recipe or recommended.yaml) or --method (with --model), not both")
    if not 0 <= port <= 65535:
        raise ConfigError(f"--port must be 0 .. 65535, got {port}")
    if slots is not None and slots < 1:
        raise ConfigError(f"--slots must be >= 1, got {slots}")
    if max_waiting < 1:
        raise ConfigError(f"--max-waiting must be >= 1, got {max_waiting}")
    if prefill_chunk < 1:
        raise ConfigError(f"--prefill-chunk must be >= 1, got {prefill_chunk}")
    if not cache_mib >= 0:
        raise ConfigError(f"--cache-mib must be >= 0, got {cache_mib}")
    api_key = None
    if api_key_env is not None:
        api_key = os.environ.get(api_key_env, "")
        if not api_key.strip():
            raise ConfigError(f"--api-key-env {api_key_env}: that environment variable is not set or empty")
    if recipe is not None:
        plan = scenario.plan_from_recipe(recipe, config_index, model)
    else:
        if model is None:
            raise ConfigError("--method needs --model")
        plan = scenario.plan_from_method(model, method, activations)
    if slots is not None:
        plan.slots = slots
    if native_step is not None:
        plan.native_step = native_step
    if compile is not None:
        plan.compile = compile
    if speculate is not None:
        if speculate < 0:
            raise ConfigError(f"--speculate must be >= 0, got {speculate}")
        plan.speculate = speculate
        if speculate and native_step is None:
            plan.native_step = True
    if kv_cache is not None:
        from infer_tune.native.step import KV_DTYPES

        if kv_cache not in KV_DTYPES:
            raise ConfigError(f"--kv-cache must be one of {', '.join(KV_DTYPES)}, got '{kv_cache}'")
        plan.kv_dtype = kv_cache
        if kv_cache != "fp32" and native_step is None:
            plan.native_step = True
    if plan.kv_dtype != "fp32" and not plan.native_step:
        raise ConfigError(f"a {plan.kv_dtype} KV cache is the native step's: drop --no-native-step")
    if ngram is not None:
        if ngram < 1:
            raise ConfigError(f"--ngram must be >= 1, got {ngram}")
        plan.ngram = ngram
    sock = listen(host, port)  # before the model loads: a port in use is one line at once, not after the load
    try:
        if not is_loopback(host) and api_key is None:
            output.warn(f"listening on {host}, beyond loopback without --api-key-env: anyone who can reach "
                        f"port {sock.getsockname()[1]} can use this server")
        for note in plan.notes:
            output.warn(note)
        output.err.print(f"loading {plan.describe()} ...", markup=False, highlight=False)
        served = scenario.build(plan, threads=threads, max_context=context, max_waiting=max_waiting,
                                prefill_chunk=prefill_chunk, prefix_cache=prefix_cache, cache_mib=cache_mib)
    except BaseException:
        sock.close()
        raise
    fallback = served.facts.get("lean_native_fallback")
    if fallback:
        output.warn(f"native step not used: {fallback}")

    def ready(url: str) -> None:
        output.err.print(f"warmed in {served.warm_s:.1f} s; serving {served.served_model} at {url} "
                         f"(Ctrl-C stops)", markup=False, highlight=False)
        print(f"READY {url}", flush=True)

    scenario.serve(served, host, port, ready, sock=sock, api_key=api_key, debug=output.state.debug)
    output.err.print(f"stopped after {served.engine.served} requests", markup=False, highlight=False)
