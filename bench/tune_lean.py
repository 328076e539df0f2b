"""Side by side in one process: llama.cpp on the model's own GGUF, `generate()` and the lean decode path
on fp32 and int4 weights, and (optionally) compile variants. Same chat prompt, greedy, pinned length.

Measures decode tok/s (1000 / median TPOT), TTFT, the lean loop's per-token overhead next to
`generate()`'s on the same weights, and the compile time. Rounds are interleaved (A B C A B C ...)
so drift of a shared host hits every row alike; run it under the CPU lock:

    flock /tmp/infer-tune-cpu.lock .venv/bin/python bench/tune_lean.py --tokens 128 --rounds 5 --threads 2

Not a test: timing on a shared machine is noisy; read the ratios of one run.
"""

from __future__ import annotations

import copy
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._common import parser, setup  # noqa: E402


def row_llamacpp(loaded, prompt: str, tokens: int, threads: int):
    from infer_tune.tuners.llamacpp import LlamaCppConfig, available, decode, gguf_for

    if not available():
        return None
    from llama_cpp import Llama

    llm = Llama(model_path=str(gguf_for(loaded, LlamaCppConfig())), n_ctx=1024, n_threads=threads,
                n_threads_batch=threads, verbose=False)

    def run():
        submit, token_ns, ids, _ = decode(llm, prompt, tokens, pin_length=True)
        return submit, token_ns, ids
    return run


def row_generate(model, ids, tokens: int, eos, **generate_kwargs):
    from transformers import GenerationConfig

    from infer_tune.runners.base import TokenClock
    from infer_tune.runners.generation import _PinLength

    def run():
        clock = TokenClock()
        config = GenerationConfig(max_new_tokens=tokens, do_sample=False, eos_token_id=eos, pad_token_id=eos[0],
                                  **generate_kwargs)
        submit = time.perf_counter_ns()
        with torch.inference_mode():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config, streamer=clock,
                                 logits_processor=[_PinLength(eos, ids.shape[1], 1)])
        return submit, clock.token_ns, out[0, ids.shape[1]:].tolist()
    return run


def row_lean(model, ids, tokens: int, eos, compile_step: bool):
    from infer_tune.tuners.lean.loop import LeanCounters, LeanDecoder

    decoder = LeanDecoder(model, compile=compile_step, counters=LeanCounters())

    def run():
        submit, token_ns, out, _ = decoder.generate(ids, tokens, eos)
        return submit, token_ns, out
    run.decoder = decoder
    return run


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--rows", default="llama.cpp,fp32-generate,fp32-lean+compile,int4-generate,int4-lean,int4-lean+compile")
    p.add_argument("--method", default="int4-rtn")
    args = p.parse_args()
    warnings.filterwarnings("ignore")
    from infer_tune.runners.generation import eos_ids
    from infer_tune.tuners.quantize import QuantizeConfig, kernel_choice
    from infer_tune.tuners.quantize.pipeline import quantize_in_memory

    loaded, inputs = setup(args)
    threads = torch.get_num_threads()
    ids, prompt = inputs.batches[0]["input_ids"], inputs.rendered[0]
    eos = eos_ids(loaded.model, loaded.tokenizer)
    int4 = copy.deepcopy(loaded.model)
    quantize_in_memory(int4, QuantizeConfig(method=args.method), "torch")
    kernel_choice.choose_for_model(int4, args.method, prefill_rows=ids.shape[1])
    makers = {
        "llama.cpp": lambda: row_llamacpp(loaded, prompt, args.tokens, threads),
        "fp32-generate": lambda: row_generate(loaded.model, ids, args.tokens, eos),
        "fp32-lean+compile": lambda: row_lean(loaded.model, ids, args.tokens, eos, True),
        "int4-generate": lambda: row_generate(int4, ids, args.tokens, eos),
        "int4-generate-static": lambda: row_generate(int4, ids, args.tokens, eos, cache_implementation="static",
                                                     disable_compile=True),
        "int4-lean": lambda: row_lean(int4, ids, args.tokens, eos, False),
        "int4-lean+compile": lambda: row_lean(int4, ids, args.tokens, eos, True),
    }
    rows = {}
    for name in args.rows.split(","):
        started = time.perf_counter()
        fn = makers[name]()
        if fn is None:
            print(f"{name}: not available")
            continue
        fn()  # warmup (compiles)
        rows[name] = {"fn": fn, "ttft": [], "tpot": [], "ids": None, "warmup_s": time.perf_counter() - started}
    for _ in range(args.rounds):
        for row in rows.values():
            submit, token_ns, out = row["fn"]()
            row["ttft"].append((token_ns[0] - submit) / 1e6)
            row["tpot"].append((token_ns[-1] - token_ns[0]) / 1e6 / (len(token_ns) - 1))
            row["ids"] = out
    ref = rows.get("llama.cpp")
    print(f"prompt {ids.shape[1]} tokens, {args.tokens} new, {threads} threads, {args.rounds} interleaved rounds")
    print(f"{'row':<30}{'decode tok/s':>13}{'TPOT cv':>9}{'TTFT ms':>9}{'TTFT cv':>9}{'vs llama.cpp':>14}{'warmup s':>10}")
    for name, row in rows.items():
        tpot, ttft = statistics.median(row["tpot"]), statistics.median(row["ttft"])
        cv = (statistics.stdev(row["tpot"]) / statistics.fmean(row["tpot"])) if len(row["tpot"]) > 1 else 0
        cvt = (statistics.stdev(row["ttft"]) / statistics.fmean(row["ttft"])) if len(row["ttft"]) > 1 else 0
        vs = f"{statistics.median(ref['tpot']) / tpot:.2f}x" if ref else "-"
        print(f"{name:<30}{1000 / tpot:>13.1f}{cv:>9.1%}{ttft:>9.1f}{cvt:>9.1%}{vs:>14}{row['warmup_s']:>10.1f}")
        decoder = getattr(row["fn"], "decoder", None)
        if decoder is not None:
            snap = decoder.counters.snapshot()
            print(f"{'':<30}lean forward {snap.get('lean_forward_ms_per_token', 0):.2f} ms/token, loop overhead "
                  f"{snap.get('lean_overhead_ms_per_token', 0):.3f} ms/token")
    for gen, lean in (("int4-generate", "int4-lean"), ("int4-generate-static", "int4-lean")):
        if gen in rows and lean in rows:  # same weights, both eager: what generate() adds per token
            extra = statistics.median(rows[gen]["tpot"]) - statistics.median(rows[lean]["tpot"])
            print(f"{gen} per-token overhead over the lean loop (same weights, eager): {extra:.2f} ms/token")
    reference = "int4-generate-static" if "int4-generate-static" in rows else "int4-generate"
    same = [n for n in rows if n.startswith("int4") and rows[n]["ids"] == rows.get(reference, {}).get("ids")]
    print(f"int4 rows with outputs identical to {reference} (same weights, same static cache):", ", ".join(same))


if __name__ == "__main__":
    main()
