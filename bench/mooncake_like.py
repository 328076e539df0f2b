"""Write a Mooncake-format trace of production length that fits a model's context.

The published Mooncake trace (kvcache-ai/Mooncake, `mooncake_trace.jsonl`: one hour of Kimi's traffic, 23,608
requests) has prompts of about 7,590 tokens on average, outputs of about 182, and blocks of 512 tokens
(`hash_ids`) that long runs of requests share: its README's two sample rows open with the same 12 blocks (6,144
tokens) and differ in their last one or two. That trace cannot be downloaded here (no model or dataset hub), and its
prompts (up to ~100K tokens) do not fit a small model's context; this script draws a trace of that shape, seeded:

- `--groups` shared prefixes (a long document, a tool list, a system prompt), each `--prefix-blocks` blocks long
  (drawn between the two numbers); each request opens with one of them (a Zipf-like choice: a few prefixes carry
  most requests, as in the trace) and adds 1-`--tail-blocks` blocks of its own;
- input lengths end inside their last block (uniform), capped at `--max-input` tokens so prompt + output fit
  the model's context;
- output lengths log-normal with median `--output-median` and mean about `--output-mean`, clipped to
  [`--min-output`, `--max-output`];
- arrivals a Poisson process at `--rate` requests/s (timestamps in ms, as the trace's).

  python bench/mooncake_like.py --requests 24 --rate 0.2 --out /tmp/mooncake-like.jsonl
  python bench/serving_vs_llamacpp.py --workload trace --trace /tmp/mooncake-like.jsonl --trace-format mooncake \\
      --block-size 512 --context 8192 ...

It prints the trace's statistics (mean input / output, share of prompt blocks a prefix cache could reuse).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def draw(args) -> list[dict]:
    rng = random.Random(args.seed)
    lo, hi = args.prefix_blocks
    prefixes, next_id = [], 0
    for _ in range(args.groups):
        n = rng.randint(lo, hi)
        prefixes.append(list(range(next_id, next_id + n)))
        next_id += n
    weights = [1.0 / (k + 1) for k in range(args.groups)]  # Zipf-like: the first prefixes carry most requests
    sigma = math.sqrt(2.0 * math.log(max(args.output_mean, args.output_median + 1e-9) / args.output_median))
    rows, t = [], 0.0
    max_blocks = max(1, args.max_input // args.block_size + (1 if args.max_input % args.block_size else 0))
    for _ in range(args.requests):
        t += rng.expovariate(args.rate)
        prefix = rng.choices(prefixes, weights)[0]
        tail = list(range(next_id, next_id + rng.randint(1, args.tail_blocks)))
        next_id += len(tail)
        blocks = (prefix + tail)[:max_blocks]
        length = (len(blocks) - 1) * args.block_size + rng.randint(1, args.block_size)
        length = min(length, args.max_input)
        blocks = blocks[:(length + args.block_size - 1) // args.block_size]
        out = int(round(rng.lognormvariate(math.log(args.output_median), sigma)))
        out = max(args.min_output, min(args.max_output, out))
        rows.append({"timestamp": round(t * 1000.0, 3), "input_length": length, "output_length": out,
                     "hash_ids": blocks})
    return rows


def stats(rows: list[dict]) -> dict:
    seen, reusable, total = set(), 0, 0
    for r in rows:
        for h in r["hash_ids"]:
            total += 1
            reusable += h in seen
            seen.add(h)
    n = len(rows)
    return {"requests": n, "duration_s": rows[-1]["timestamp"] / 1000.0 if rows else 0.0,
            "mean_input": sum(r["input_length"] for r in rows) / n, "max_input": max(r["input_length"] for r in rows),
            "mean_output": sum(r["output_length"] for r in rows) / n,
            "reusable_block_share": reusable / total if total else 0.0}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=24)
    p.add_argument("--rate", type=float, default=0.2, help="arrivals a second (Poisson)")
    p.add_argument("--groups", type=int, default=6, help="shared prefixes")
    p.add_argument("--prefix-blocks", type=lambda s: tuple(int(x) for x in s.split(",")), default=(6, 12),
                   help="blocks of a shared prefix, drawn between LO,HI (default 6,12: 3,072-6,144 tokens)")
    p.add_argument("--tail-blocks", type=int, default=2, help="each request's own blocks: 1..N")
    p.add_argument("--block-size", type=int, default=512)
    p.add_argument("--max-input", type=int, default=7600, help="prompt tokens at most (context minus output)")
    p.add_argument("--output-median", type=float, default=128.0)
    p.add_argument("--output-mean", type=float, default=182.0)
    p.add_argument("--min-output", type=int, default=16)
    p.add_argument("--max-output", type=int, default=512)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    if args.requests < 1 or args.rate <= 0 or args.groups < 1 or args.block_size < 1 or args.max_input < 1:
        p.error("--requests, --rate, --groups, --block-size and --max-input must be positive")
    if not (1 <= args.prefix_blocks[0] <= args.prefix_blocks[-1]) or args.tail_blocks < 1:
        p.error("--prefix-blocks LO,HI needs 1 <= LO <= HI and --tail-blocks >= 1")
    if not (0 < args.output_median <= args.output_mean) or args.min_output > args.max_output:
        p.error("--output-median must be > 0 and <= --output-mean; --min-output <= --max-output")
    rows = draw(args)
    from infer_tune import atomic

    atomic.write_text(Path(args.out), "".join(json.dumps(r) + "\n" for r in rows))
    s = stats(rows)
    print(f"wrote {args.out}: {s['requests']} requests over {s['duration_s']:.1f} s, mean input "
          f"{s['mean_input']:.0f} tokens (max {s['max_input']}), mean output {s['mean_output']:.0f}, "
          f"{s['reusable_block_share']:.1%} of prompt blocks seen before (a prefix cache's best hit rate)")


if __name__ == "__main__":
    main()
