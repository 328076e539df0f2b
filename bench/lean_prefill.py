"""TTFT of the lean path with the eager prefill and with the compiled prefill buckets, side by side in one
process: the same int4 weights, a ~40-token and a ~500-token prompt, greedy, rounds interleaved.

Only the prefill differs between the two rows (tuners/lean/prefill.py); TTFT is the prefill and the first
argmax, so the timed requests generate one token and the decode step stays eager (it never enters TTFT,
and no decode graph has to compile). Every prompt runs once before timing (the prefill compiles land
there); the outputs of the two rows are then compared over `--tokens` greedy tokens. With llama-cpp-python installed, llama.cpp
on the `--gguf` GGUF runs the same prompts in the same rounds (the TTFT targets: <= 1.2x llama.cpp at ~40
tokens, <= 1.0x at ~500). With `--llama-server` instead, llama.cpp's C++ server (scripts/build-llama-cpp.sh)
runs them in the same rounds on `--gguf`: `best` (the default) is the fastest of Q4_0 / Q4_K_M / Q8_0 made
from the same checkpoint, timed by llama-bench at these prompts' lengths first (infer_tune/engines/llamacpp.py;
the line printed says which, with every format's figures and the llama.cpp commit), `shipped` the model's own
GGUF (SmolLM2's Q4_1, llama.cpp's slowest 4-bit path on x86). Its figure is the
server's own prompt time (`timings.prompt_ms`, no HTTP in it; the client's wall time is printed beside
it), and with `--decode-tokens N` its single-stream decode (`predicted_per_second`, end-of-sequence
ignored) runs three passes interleaved with the lean path's. Run it under the CPU lock:

    flock /tmp/infer-tune-cpu.lock python bench/lean_prefill.py --threads 2 --rounds 7
    flock /tmp/infer-tune-cpu.lock python bench/lean_prefill.py --threads 2 --rounds 7 --llama-server --decode-tokens 128
    flock /tmp/infer-tune-cpu.lock python bench/lean_prefill.py --threads 2 --rounds 7 --llama-server --decode-tokens 128 --native-step
    flock /tmp/infer-tune-cpu.lock python bench/lean_prefill.py --threads 2 --rounds 7 --llama-server --gguf shipped
    flock /tmp/infer-tune-cpu.lock python bench/lean_prefill.py --threads 2 --rounds 3 --decode-tokens 64 --native-step --after-fp32

Not a test: read the ratios of one run.
"""

from __future__ import annotations

import statistics
import sys
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._common import parser  # noqa: E402


def prompts(tokenizer, short: int, long: int) -> dict[str, torch.Tensor]:
    """Chat-templated prompts of at least `short` and `long` tokens (a question, longer by a sentence at a time;
    a long document to summarize)."""
    base = "Summarize the following notes about caches, batching and quantization in two sentences. "
    filler = ("A key-value cache keeps the keys and values of earlier tokens so that each decoding step "
              "only computes the newest position; batching shares each weight read among many requests. ")
    more = " Explain each step, its cost and when it is slow."
    out = {}
    for name, target, body, grow in (("short", short, "Write quicksort in Python.", more), ("long", long, base, filler)):
        text = body
        while True:
            ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                                return_tensors="pt", return_dict=True)["input_ids"]
            if ids.shape[1] >= target:
                break
            text += grow
        out[name] = ids
    return out


def main() -> None:
    from contextlib import ExitStack

    with ExitStack() as stack:
        run(stack)


def run(stack) -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=16, help="greedy tokens compared between the two rows")
    p.add_argument("--decode-tokens", type=int, default=0,
                   help="also a single-stream decode row of the compiled lean path (compiles its step; 0: none)")
    p.add_argument("--short", type=int, default=40, help="tokens of the short prompt, at least (a chat question)")
    p.add_argument("--long", type=int, default=500)
    p.add_argument("--method", default="int4-rtn")
    p.add_argument("--activations", default="int8", choices=("bf16", "int8"),
                   help="int8: the w4a8 / w8a8 kernels (quantize's activations: int8); bf16: torch's int4 kernel")
    p.add_argument("--cpp-wrapper", action="store_true", help="the decode row's step with inductor's C++ wrapper")
    p.add_argument("--native-step", action="store_true",
                   help="the decode row's step in one native call (int4 a8 Llama models: infer_tune/native/step.py)")
    p.add_argument("--after-fp32", action="store_true",
                   help="with --decode-tokens: three more decode passes, each right after an fp32 generate() of the "
                        "same prompt (what interleaved rounds do to the step: caches and threads used by another model)")
    p.add_argument("--llama-server", action="store_true",
                   help="llama.cpp's C++ server (scripts/build-llama-cpp.sh) as the reference, same rounds")
    p.add_argument("--gguf", default="best",
                   help="the reference's GGUF: best (fastest of q4_0 / q4_k_m / q8_0 here), shipped, a type, or a path")
    args = p.parse_args()
    warnings.filterwarnings("ignore")
    from infer_tune import models
    from infer_tune.runners.generation import eos_ids
    from infer_tune.scenarios.common import setup_threads
    from infer_tune.tuners.lean.loop import LeanDecoder
    from infer_tune.tuners.quantize import QuantizeConfig, kernel_choice
    from infer_tune.tuners.quantize.pipeline import quantize_in_memory

    setup_threads(args.threads)
    loaded = models.load(args.model)
    model = loaded.model
    quantize_in_memory(model, QuantizeConfig(method=args.method, activations=args.activations), "torch")
    record = kernel_choice.choose_for_model(model, args.method, prefill_rows=64, activations=args.activations)
    kernel_choice.make_traceable(model, record)
    eos = eos_ids(model, loaded.tokenizer)
    cases = prompts(loaded.tokenizer, args.short, args.long)
    rows = {"eager prefill": LeanDecoder(model, compile=False, compile_prefill=False),
            "compiled prefill": LeanDecoder(model, compile=False, compile_prefill=True)}
    runs = {}
    llm = None
    from infer_tune.tuners.llamacpp import available
    reference_gguf = None
    if available() or args.llama_server:
        from infer_tune.engines import llamacpp as engine

        reference_gguf, chosen = engine.reference_gguf(args.model, args.gguf, [c.shape[1] for c in cases.values()],
                                                       args.decode_tokens or 128, torch.get_num_threads())
        print(f"reference: {engine.describe(reference_gguf, chosen)}")
    if available():
        from llama_cpp import Llama

        from infer_tune.tuners.llamacpp import decode
        llm = Llama(model_path=str(reference_gguf), n_ctx=1024, n_threads=torch.get_num_threads(),
                    n_threads_batch=torch.get_num_threads(), verbose=False)
    server = None
    if args.llama_server:  # stopped when main returns or fails (its process group would outlive us)
        from infer_tune.endpoint.servers import local_server

        server = stack.enter_context(local_server("llama.cpp", str(reference_gguf), threads=torch.get_num_threads()))
        for ids in cases.values():
            server_completion(server.url, loaded.tokenizer.decode(ids[0]), 1)  # warms the server
    for name, decoder in rows.items():
        started = time.perf_counter()
        for ids in cases.values():
            decoder.generate(ids, 1, eos)  # compiles: outside the timed rounds
        print(f"{name}: warmup {time.perf_counter() - started:.1f} s, {decoder.facts.get('lean_prefill')}, "
              f"buckets {decoder.facts.get('lean_prefill_buckets')}")
    refs = (["llama.cpp"] if llm else []) + (["llama-server", "llama-server client"] if server else [])
    ttft: dict = {(r, c): [] for r in list(rows) + refs for c in cases}
    for _ in range(args.rounds):
        for case, ids in cases.items():
            for name, decoder in rows.items():
                submit, token_ns, _, _ = decoder.generate(ids, 1, eos)
                ttft[(name, case)].append((token_ns[0] - submit) / 1e6)
            if llm is not None:
                text = loaded.tokenizer.decode(ids[0])
                submit, token_ns, _, _ = decode(llm, text, 1, pin_length=True)
                ttft[("llama.cpp", case)].append((token_ns[0] - submit) / 1e6)
            if server is not None:
                answer, wall_ms = server_completion(server.url, loaded.tokenizer.decode(ids[0]), 1)
                ttft[("llama-server", case)].append(answer["timings"]["prompt_ms"])
                ttft[("llama-server client", case)].append(wall_ms)
    for (name, decoder), case in ((r, c) for r in rows.items() for c in cases):
        runs[(name, case)] = decoder.generate(cases[case], args.tokens, eos)[2]
    print(f"{args.method} weights ({args.activations} activations), {torch.get_num_threads()} threads, {args.rounds} interleaved rounds, "
          f"TTFT median ms (min-max)")
    for case, ids in cases.items():
        eager = statistics.median(ttft[("eager prefill", case)])
        for name in [r for r in ttft if r[1] == case]:
            values = ttft[name]
            print(f"  {case} prompt ({ids.shape[1]} tokens)  {name[0]:<17} {statistics.median(values):8.2f} "
                  f"({min(values):.2f}-{max(values):.2f})  eager/this {eager / statistics.median(values):.2f}x")
        print(f"  {case}: outputs identical: {runs[('eager prefill', case)] == runs[('compiled prefill', case)]}")
    if args.decode_tokens:  # single-stream decode of the whole lean path (compiled step), three passes
        full = LeanDecoder(model, compile=True, cpp_wrapper=args.cpp_wrapper, native_step=args.native_step)
        full._prefill = rows["compiled prefill"]._prefill  # the prefill graphs compiled above
        full.generate(cases["short"], args.decode_tokens, eos)
        speeds, theirs = [], []
        text = loaded.tokenizer.decode(cases["short"][0])
        for _ in range(3):
            _, token_ns, _, _ = full.generate(cases["short"], args.decode_tokens, eos)
            speeds.append((len(token_ns) - 1) * 1e9 / (token_ns[-1] - token_ns[0]))
            if server is not None:
                theirs.append(server_completion(server.url, text, args.decode_tokens)[0]["timings"]["predicted_per_second"])
        print(f"{'lean+native' if args.native_step else 'lean+compile'} single-stream decode, {args.decode_tokens} "
              f"tokens after the short prompt: "
              f"{', '.join(f'{v:.1f}' for v in speeds)} tok/s ({full.facts.get('lean_step')}, attention "
              f"{full.facts.get('lean_attention')}; {len(token_ns)} tokens in the last pass)")
        print(roofline_line(model, cases["short"].shape[1] + args.decode_tokens / 2, max(speeds)))
        if theirs:
            print(f"llama-server single-stream decode, {args.decode_tokens} tokens (end-of-sequence ignored): "
                  f"{', '.join(f'{v:.1f}' for v in theirs)} tok/s; best of three vs best of three: "
                  f"{max(speeds) / max(theirs):.2f}x")
        if args.after_fp32:
            plain = models.load(args.model).model
            after = []
            for _ in range(3):
                with torch.inference_mode():
                    plain.generate(cases["short"], max_new_tokens=args.decode_tokens, do_sample=False)
                _, token_ns, _, _ = full.generate(cases["short"], args.decode_tokens, eos)
                after.append((len(token_ns) - 1) * 1e9 / (token_ns[-1] - token_ns[0]))
            print(f"the same decode right after an fp32 generate of the prompt: "
                  f"{', '.join(f'{v:.1f}' for v in after)} tok/s (alone above: {', '.join(f'{v:.1f}' for v in speeds)})")


def roofline_line(model, mean_context: float, tok_s: float) -> str:
    """The best pass's `roofline_fraction`, as the result documents define it (metrics/roofline.py): decode
    tok/s over the bandwidth ceiling of the weights' bytes plus the KV cache read at the mean context."""
    from infer_tune import models
    from infer_tune.env import bandwidth_reading
    from infer_tune.metrics import kv, roofline

    reading = bandwidth_reading()
    kv_read = kv.kv_bytes(kv.ModelShape.from_config(model.config), 1, 32) * mean_context
    facts = roofline.roofline(reading["gb_s"], models.model_bytes(model), kv_read, 1, 1000.0 / tok_s)
    return (f"roofline: {models.model_bytes(model) / 2**20:.1f} MiB of weights + {kv_read / 2**20:.1f} MiB of KV per "
            f"token at {reading['gb_s']:.1f} GB/s ({reading['source']}): ceiling {facts['roofline_tok_s']:.1f} tok/s, "
            f"roofline_fraction {fraction_text(facts)} at {tok_s:.1f} tok/s")


def fraction_text(facts: dict) -> str:
    """A fraction of the ceiling, or `refused` with why (above 1: metrics/roofline.py)."""
    if facts.get("roofline_fraction") is None:
        return f"refused ({facts['roofline_refused']})" if facts.get("roofline_refused") else "-"
    return f"{facts['roofline_fraction']:.2f}"


def server_completion(url: str, text: str, n_predict: int) -> tuple[dict, float]:
    """(llama-server's answer, the client's wall ms) of one greedy `/completion`, prompt cache off."""
    import json
    import urllib.request

    body = json.dumps({"prompt": text, "n_predict": n_predict, "cache_prompt": False, "temperature": 0,
                       "ignore_eos": True}).encode()
    request = urllib.request.Request(f"{url.rsplit('/v1', 1)[0]}/completion", data=body,
                                     headers={"Content-Type": "application/json"})
    started = time.perf_counter()
    with urllib.request.urlopen(request, timeout=300) as response:  # noqa: S310 (loopback)
        answer = json.loads(response.read())
    return answer, (time.perf_counter() - started) * 1e3


if __name__ == "__main__":
    main()
