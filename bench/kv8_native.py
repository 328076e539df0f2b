"""The native step's int8 KV cache against its fp32 cache on one model: quality, bytes and decode time by context.

    python bench/kv8_native.py --model smollm2-135m --contexts 256,1024,1900 --tokens 48 --repeats 5 --threads 2

- quality: teacher-forced perplexity of the chat suite's references through the native step's rows on each cache
  (`native_rows_nll`, what a row decoding on that cache reports as `ppl`), and the eager forward's for reference;
- bytes: the cache of `--slots` slots x `--slot-context` positions (`NativeCache.nbytes`, what `serve` allocates);
- time: the lean loop's native step on each cache, a random prompt of each context length, `--tokens` greedy
  tokens, the two caches alternated (ABAB...) `--repeats` times; TPOT per run, the ratio int8 / fp32 per pair
  with a 95% t-interval of its log (metrics/stats.py), greedy tokens compared.
Prints one JSON object."""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--contexts", default="256,1024,1900")
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--slots", type=int, default=4)
    ap.add_argument("--slot-context", type=int, default=2048)
    args = ap.parse_args()

    import torch

    from infer_tune import models
    from infer_tune.metrics.perplexity import perplexity, reference_sequences, sequence_nll
    from infer_tune.metrics.stats import log_ratio_interval
    from infer_tune.native.perplexity import native_rows_nll
    from infer_tune.native.step import NativeCache, recognize
    from infer_tune.suites import SuiteSpec, load_suite
    from infer_tune.tuners.lean.loop import LeanDecoder
    from infer_tune.tuners.quantize import QuantizeConfig
    from infer_tune.tuners.quantize.pipeline import quantize_in_memory

    torch.set_num_threads(args.threads)
    loaded = models.load(args.model)
    model = loaded.model.eval()
    quantize_in_memory(model, QuantizeConfig(method="int4-rtn", activations="int8"), "torch")
    parts, why = recognize(model)
    if parts is None:
        raise SystemExit(f"the native step does not run {args.model}: {why}")
    out: dict = {"model": args.model, "host": platform.processor() or platform.machine(), "threads": args.threads,
                 "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}

    prompts = load_suite(SuiteSpec("chat", limit=16))
    tok = loaded.tokenizer
    rendered = [tok.apply_chat_template([{"role": "user", "content": p.text}], tokenize=False,
                                        add_generation_prompt=True) for p in prompts]
    scored = reference_sequences(tok, rendered, [p.reference for p in prompts])
    with torch.inference_mode():
        out["ppl"] = {"eager": perplexity(*sequence_nll(model, scored)),
                      **{d: perplexity(*native_rows_nll(model, parts, scored, d)) for d in ("fp32", "int8")}}
    out["ppl"]["int8_vs_fp32_pct"] = 100 * (out["ppl"]["int8"] / out["ppl"]["fp32"] - 1)
    out["cache_mib"] = {d: NativeCache(parts, args.slots, args.slot_context, d).nbytes / 2**20 for d in ("fp32", "int8")}
    out["cache_mib"]["shape"] = f"{args.slots} slots x {args.slot_context} positions"

    decoders = {d: LeanDecoder(model, compile=False, native_step=True, kv_dtype=d) for d in ("fp32", "int8")}
    eos = []  # pinned length: every run decodes --tokens tokens
    out["by_context"] = []
    gen = torch.Generator().manual_seed(0)
    for context in (int(c) for c in args.contexts.split(",")):
        ids = torch.randint(100, model.config.vocab_size - 100, (1, context), generator=gen)
        for d in decoders.values():
            d.reserve(context + args.tokens)
            d.generate(ids, 4, eos)  # warm
        tpot = {"fp32": [], "int8": []}
        same = True
        for r in range(args.repeats):
            tokens = {}
            for d in (("fp32", "int8") if r % 2 == 0 else ("int8", "fp32")):
                _, stamps, tokens[d], _ = decoders[d].generate(ids, args.tokens, eos)
                tpot[d].append((stamps[-1] - stamps[0]) / 1e6 / (len(stamps) - 1))
            same = same and tokens["fp32"] == tokens["int8"]
        ratio = log_ratio_interval([b / a for a, b in zip(tpot["fp32"], tpot["int8"])])
        out["by_context"].append({"context": context, "tpot_ms_fp32": statistics.median(tpot["fp32"]),
                                  "tpot_ms_int8": statistics.median(tpot["int8"]), "int8_over_fp32": ratio,
                                  "same_tokens": same})
        print(json.dumps(out["by_context"][-1]), flush=True)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
