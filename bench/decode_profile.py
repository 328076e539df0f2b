"""Where a compiled lean decode step's time goes, against what its bytes need at the measured bandwidth.

Quantizes the model (`--method`, `--activations`), builds the lean decode path (captured step, `--attention`,
optionally inductor's C++ wrapper), decodes once to compile, then profiles two decodes of different lengths
from the same prompt with torch.profiler and takes their difference, so the prefill and the first step
cancel and what is left is per decode step. Prints, per step: each op's self time (the int4 / int8
kernels, attention, the compiled graph's own time = inductor's wrapper and fused kernels), its share,
calls per step, and the time the weights' bytes and the cache's (fp32 keys and values up to the mean
profiled position) need at the host's measured bandwidth (the roofline). Profiling adds overhead of its
own; the unprofiled decode speed is printed beside it. `--prompt-tokens N` decodes after a longer prompt.

`--ab-checks N`: also compiles the same step with inductor's per-call input checks kept (what the lean
step drops, `loop.CHECKED_ONCE`) and decodes with the two in N interleaved rounds (order alternating), then
prints each one's median and the 95% interval of the per-round speed ratio (without / with the checks).
`--ab-cache N`: the same, for the step decoding in a cache of `--big-cache` positions (one cache sized for
a run's longest request, `LeanDecoder.one_cache`) against one sized for this prompt.

    flock /tmp/infer-tune-cpu.lock .venv/bin/python bench/decode_profile.py --threads 2
    flock /tmp/infer-tune-cpu.lock .venv/bin/python bench/decode_profile.py --threads 2 --activations bf16 --attention sdpa
    flock /tmp/infer-tune-cpu.lock .venv/bin/python bench/decode_profile.py --threads 2 --cpp-wrapper --ab-checks 9
    flock /tmp/infer-tune-cpu.lock .venv/bin/python bench/decode_profile.py --threads 2 --ab-cache 9

Not a test: read the shares of one run.
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

from bench._common import parser  # noqa: E402


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--method", default="int4-rtn")
    p.add_argument("--activations", default="int8", choices=("bf16", "int8"))
    p.add_argument("--attention", default="native", choices=("native", "sdpa"))
    p.add_argument("--cpp-wrapper", action="store_true")
    p.add_argument("--short", type=int, default=16, help="tokens of the shorter profiled decode")
    p.add_argument("--long", type=int, default=48, help="tokens of the longer one")
    p.add_argument("--top", type=int, default=14)
    p.add_argument("--prompt-tokens", type=int, default=0,
                   help="decode after a prompt of about this many tokens (the request repeated; 0: the request once)")
    p.add_argument("--ab-checks", type=int, default=0, metavar="N",
                   help="interleaved rounds against the same step compiled with inductor's per-call checks")
    p.add_argument("--ab-cache", type=int, default=0, metavar="N",
                   help="interleaved rounds against the same step decoding in a cache of --big-cache positions")
    p.add_argument("--big-cache", type=int, default=640, help="positions of the large cache of --ab-cache")
    args = p.parse_args()
    warnings.filterwarnings("ignore")
    from torch.profiler import ProfilerActivity, profile

    from infer_tune import models
    from infer_tune.env import bandwidth_reading
    from infer_tune.metrics import kv
    from infer_tune.runners.generation import eos_ids
    from infer_tune.scenarios.common import setup_threads
    from infer_tune.tuners.lean.loop import LeanDecoder
    from infer_tune.tuners.quantize import QuantizeConfig, kernel_choice
    from infer_tune.tuners.quantize.pipeline import quantize_in_memory

    setup_threads(args.threads)
    loaded = models.load(args.model)
    tok = loaded.tokenizer
    request = "Write quicksort in Python."
    ids = tok.apply_chat_template([{"role": "user", "content": request}], add_generation_prompt=True,
                                  return_tensors="pt", return_dict=True)["input_ids"]
    while ids.shape[1] < args.prompt_tokens:  # a longer context: the request repeated
        request += " Write quicksort in Python."
        ids = tok.apply_chat_template([{"role": "user", "content": request}], add_generation_prompt=True,
                                      return_tensors="pt", return_dict=True)["input_ids"]
    eos = eos_ids(loaded.model, tok)
    model = copy.deepcopy(loaded.model)
    quantize_in_memory(model, QuantizeConfig(method=args.method, activations=args.activations), "torch")
    record = kernel_choice.choose_for_model(model, args.method, prefill_rows=64, activations=args.activations)
    kernel_choice.make_traceable(model, record)
    decoder = LeanDecoder(model, compile=True, cpp_wrapper=args.cpp_wrapper, native_attention=args.attention == "native")
    started = time.perf_counter()
    decoder.generate(ids, args.long + 1, eos)
    print(f"prompt of {ids.shape[1]} tokens; {args.method} ({args.activations} activations), decode kernels {record['decode']['chosen']}, step "
          f"{decoder.facts.get('lean_step')}, attention {decoder.facts.get('lean_attention')}, "
          f"compiled in {time.perf_counter() - started:.0f} s, {torch.get_num_threads()} threads")
    def decode_tok_s(dec: LeanDecoder) -> float:
        _, token_ns, _, _ = dec.generate(ids, args.long + 1, eos)
        return (len(token_ns) - 1) * 1e9 / (token_ns[-1] - token_ns[0])

    speeds = [decode_tok_s(decoder) for _ in range(3)]
    print(f"unprofiled decode: {', '.join(f'{v:.1f}' for v in speeds)} tok/s "
          f"(median {statistics.median(speeds):.1f}: {1000 / statistics.median(speeds):.2f} ms/step)")

    if args.ab_checks:
        ab_checks(decoder, decode_tok_s, args)
    if args.ab_cache:
        ab_cache(decoder, decode_tok_s, args)

    def profiled(n: int) -> dict:
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            decoder.generate(ids, n, eos)
        return {e.key: (e.self_cpu_time_total, e.count) for e in prof.key_averages()}

    short, long = profiled(args.short), profiled(args.long)
    steps = args.long - args.short
    rows = sorted((((long[k][0] - short.get(k, (0, 0))[0]) / steps / 1e3), (long[k][1] - short.get(k, (0, 0))[1]) / steps, k)
                  for k in long)
    total = sum(r[0] for r in rows)
    reading = bandwidth_reading()
    weight_bytes = models.model_bytes(model)
    context = ids.shape[1] + (args.short + args.long) / 2  # the mean position of the profiled steps
    kv_bytes = kv.kv_bytes(kv.ModelShape.from_config(model.config), 1, 32) * context  # fp32 keys and values per step
    need_ms = (weight_bytes + kv_bytes) / (reading["gb_s"] * 1e9) * 1e3
    print(f"profiled: {total:.2f} ms per decode step; the weights' {weight_bytes / 2**20:.1f} MiB and the cache's "
          f"{kv_bytes / 2**20:.1f} MiB need {need_ms:.2f} ms "
          f"at {reading['gb_s']:.1f} GB/s ({reading['source']}): roofline_fraction of this step "
          f"{need_ms / total:.2f} profiled, {need_ms * statistics.median(speeds) / 1000:.2f} unprofiled")
    print(f"{'ms/step':>8} {'share':>6} {'calls':>6}  op")
    for ms, calls, key in rows[::-1][:args.top]:
        print(f"{ms:8.3f} {ms / total:6.1%} {calls:6.1f}  {key[:100]}")


def ab_checks(decoder, decode_tok_s, args) -> None:
    """The step as the lean path compiles it against the same step with inductor's per-call checks kept."""
    from infer_tune.tuners.lean import loop

    dropped = loop.CHECKED_ONCE
    loop.CHECKED_ONCE = {}
    try:
        checked = loop.LeanDecoder(decoder.model, compile=True, cpp_wrapper=args.cpp_wrapper,
                                   native_attention=args.attention == "native")
        decode_tok_s(checked)  # compiles, outside the rounds
    finally:
        loop.CHECKED_ONCE = dropped
    interleaved(decoder, checked, args.ab_checks, decode_tok_s, "per-call checks dropped (the lean step)", "kept")


def ab_cache(decoder, decode_tok_s, args) -> None:
    """The step in a cache sized for this prompt against the same step in one of `--big-cache` positions."""
    from infer_tune.tuners.lean import loop

    big = loop.LeanDecoder(decoder.model, compile=True, cpp_wrapper=args.cpp_wrapper,
                           native_attention=args.attention == "native")
    big.reserve(args.big_cache)
    decode_tok_s(big)  # compiles, outside the rounds
    print(f"caches: {decoder.facts.get('lean_cache_buckets')} against {big.facts.get('lean_cache_buckets')} "
          f"(one cache: {big.one_cache})")
    interleaved(decoder, big, args.ab_cache, decode_tok_s, "cache sized for the prompt", f"{args.big_cache}-position")


def interleaved(first, second, rounds: int, decode_tok_s, first_name: str, second_name: str) -> None:
    """Decode with two decoders in `rounds` interleaved rounds (order alternating); print each one's median
    tok/s and the 95% interval of the per-round ratio first / second."""
    from infer_tune.metrics.stats import log_ratio_interval

    a, b = [], []
    for r in range(rounds):
        pair = [(a, first), (b, second)]
        for out, dec in (pair if r % 2 == 0 else pair[::-1]):
            out.append(decode_tok_s(dec))
    ratio = log_ratio_interval([x / y for x, y in zip(a, b)])
    print(f"{first_name}: {statistics.median(a):.1f} tok/s median; {second_name}: {statistics.median(b):.1f}; ratio "
          f"{ratio['point']:.3f} [{ratio['ci95'][0]:.3f}, {ratio['ci95'][1]:.3f}] (95%, {ratio['rounds']} interleaved rounds)")


if __name__ == "__main__":
    main()
