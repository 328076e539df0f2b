"""TTFT probe: time prefill + first argmax directly and compare with the runner's TTFT.

Rounds are interleaved (probe, runner, ...); ratio = median runner TTFT / median probe TTFT per
prompt, then the median over prompts. Target: within 5%.

    python bench/ttft_probe.py --limit 4 --rounds 5
"""

from __future__ import annotations

import statistics
import time

import torch
from _common import parser, setup

from infer_tune.runners.generation import generate_once
from infer_tune.runners.prepared import PreparedModel


def probe_ttft_ms(model, batch) -> float:
    """Prefill forward pass + argmax of the last position, nothing else."""
    start = time.perf_counter_ns()
    with torch.inference_mode():
        logits = model(**batch, use_cache=True, logits_to_keep=1).logits  # [B, 1, V]
        logits[:, -1].argmax(dim=-1).tolist()
    return (time.perf_counter_ns() - start) / 1e6


def main() -> None:
    args = parser(__doc__).parse_args()
    loaded, inputs = setup(args)
    prepared = PreparedModel(loaded.model, loaded.tokenizer)
    probe_ttft_ms(loaded.model, inputs.batches[0])
    generate_once(prepared, inputs.batches[0], 2)
    ratios = []
    for i, batch in enumerate(inputs.batches):
        probe, runner = [], []
        for _ in range(args.rounds):
            probe.append(probe_ttft_ms(loaded.model, batch))
            submit_ns, token_ns, _, _ = generate_once(prepared, batch, 2)
            runner.append((token_ns[0] - submit_ns) / 1e6)
        p, r = statistics.median(probe), statistics.median(runner)
        ratios.append(r / p)
        print(f"prompt {i} ({batch['input_ids'].shape[1]} tokens): probe {p:.2f} ms, runner TTFT {r:.2f} ms, "
              f"ratio {r / p:.4f}")
    print(f"median runner/probe TTFT ratio {statistics.median(ratios):.4f} (target within 5%)")


if __name__ == "__main__":
    main()
