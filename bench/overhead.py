"""Runner overhead: decode tokens/s of `measure_generation` vs a bare `model.generate` loop.

Same process, same prompts, rounds interleaved (bare, runner, bare, runner...) so drift of the
machine hits both sides. Overhead = median over rounds of (runner time / bare time) - 1.
Target: <= 2%.

    python bench/overhead.py --limit 4 --max-new-tokens 32 --rounds 5
"""

from __future__ import annotations

import statistics
import time

import torch
from _common import parser, setup

from infer_tune.runners import Protocol, measure_generation
from infer_tune.runners.prepared import PreparedModel


def bare_pass(model, tokenizer, batches, max_new_tokens: int) -> float:
    """Seconds to generate exactly `max_new_tokens` for every batch with plain `generate`."""
    start = time.perf_counter()
    with torch.inference_mode():
        for batch in batches:
            model.generate(**batch, max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens, do_sample=False,
                           pad_token_id=tokenizer.pad_token_id)
    return time.perf_counter() - start


def main() -> None:
    args = parser(__doc__).parse_args()
    loaded, inputs = setup(args)
    prepared = PreparedModel(loaded.model, loaded.tokenizer)
    once = Protocol(warmup=0, min_iterations=1, min_duration_s=0)
    bare_pass(loaded.model, loaded.tokenizer, inputs.batches[:1], 4)  # warmup both paths
    measure_generation(prepared, inputs.batches[:1], 4, once)
    ratios = []
    for r in range(args.rounds):
        bare_s = bare_pass(loaded.model, loaded.tokenizer, inputs.batches, args.max_new_tokens)
        run = measure_generation(prepared, inputs.batches, args.max_new_tokens, once)
        tokens = run.generated_tokens
        ratios.append(run.measured_wall_s / bare_s)
        print(f"round {r + 1}: bare {tokens / bare_s:.2f} tok/s, runner {tokens / run.measured_wall_s:.2f} tok/s, "
              f"runner/bare time {ratios[-1]:.4f}")
    median = statistics.median(ratios)
    print(f"median runner/bare time ratio {median:.4f} -> overhead {100 * (median - 1):+.2f}% (target <= 2%)")


if __name__ == "__main__":
    main()
