"""The one-row w4a8 GEMV (a decode step's matmuls) of the working tree against the same kernel at a git revision,
interleaved in one process, on a real size's shapes.

Builds the revision's `infer_tune/native/` C++ sources into a library of their own (bench/native_ab.py's
`build_then`), packs `--layers` layers of `--preset`'s seven int4 matrices (q, k, v, o, gate, up, down; random
values, `--group-size`) with each revision's own `pack_w4a8`, checks both give the same values bit for bit, then
times `--rounds` rounds (order alternating) of one pass of `w4a8_mm` over every matrix at one activation row
(each layer its own weights, so they stream from memory as in a decode step), and in the same rounds a plain
read of the same bytes (a sum over each packed tensor as int64, what the memory gives a torch reduction).

Prints each side's median pass, the GB/s it reads, and the 95% interval of the per-round time ratio (now / then).

    flock /tmp/infer-tune-cpu.lock .venv/bin/python bench/gemv_ab.py --against HEAD~1 --preset qwen3-4b

Not a test: read the ratios of one run.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

def layer_shapes(preset: str) -> list[tuple[int, int]]:
    """(inputs, outputs) of one layer's seven matmuls (q, k, v, o, gate, up, down) of an architecture preset."""
    from infer_tune import weights

    config, _ = weights.architecture_config(preset)
    hidden, inter = config.hidden_size, config.intermediate_size
    head = getattr(config, "head_dim", None) or hidden // config.num_attention_heads
    q, kv = config.num_attention_heads * head, config.num_key_value_heads * head
    return [(hidden, q), (hidden, kv), (hidden, kv), (q, hidden), (hidden, inter), (hidden, inter), (inter, hidden)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--against", default="HEAD", help="the git revision to compare with")
    p.add_argument("--preset", default="qwen3-4b", help="an architecture preset (docs/commands.md, --weights random)")
    p.add_argument("--group-size", type=int, default=128)
    p.add_argument("--layers", type=int, default=6, help="layers of weights per pass (each its own copy)")
    p.add_argument("--rounds", type=int, default=40)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()

    from bench.native_ab import build_then, pack_then
    from infer_tune import native
    from infer_tune.metrics.stats import log_ratio_interval
    from infer_tune.scenarios.common import setup_threads
    from infer_tune.tuners.quantize.modules import pack_nibbles, pack_w4a8

    setup_threads(args.threads)
    native.w4a8()
    build_then(args.against, Path(tempfile.mkdtemp(prefix="infer-tune-gemv-ab-")))
    now_op, then_op = torch.ops.infer_tune_native.w4a8_mm, torch.ops.ab_native.w4a8_mm
    g, gen = args.group_size, torch.Generator().manual_seed(0)
    old_pack = pack_then(args.against)
    first = []
    for k, n in layer_shapes(args.preset):
        q = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=gen)
        scale, zero = torch.rand(n, k // g, generator=gen) * 0.02 + 1e-3, torch.randn(n, k // g, generator=gen) * 0.01
        nibbles = pack_nibbles(q)
        first.append((k, pack_w4a8(nibbles, scale, zero, g), old_pack(nibbles, scale, zero, g)))
    mats = first + [(k, a.clone(), b.clone()) for _ in range(args.layers - 1) for k, a, b in first]
    xs = {k: torch.randn(1, k, generator=gen) for k, _, _ in first}
    for k, new_w, old_w in first:
        assert torch.equal(now_op(xs[k], new_w, g), then_op(xs[k], old_w, g)), \
            "the two revisions' w4a8 give different values"
    now_bytes = sum(a.numel() for _, a, _ in mats)
    then_bytes = sum(b.numel() for _, _, b in mats)

    sides = {
        "now": lambda: [now_op(xs[k], w, g) for k, w, _ in mats],
        "then": lambda: [then_op(xs[k], w, g) for k, _, w in mats],
        "read": lambda: [w.view(torch.int64).sum() if w.numel() % 8 == 0 else w.sum() for _, w, _ in mats],
    }
    times = {name: [] for name in sides}
    with torch.inference_mode():
        for fn in sides.values():
            fn()
        for r in range(args.rounds):
            for name in (list(sides) if r % 2 == 0 else list(sides)[::-1]):
                started = time.perf_counter_ns()
                sides[name]()
                times[name].append((time.perf_counter_ns() - started) / 1e9)
    print(f"{args.preset} g{g}: {len(mats)} one-row w4a8 matmuls a pass ({args.layers} layers, "
          f"{now_bytes / 2**20:.0f} MiB), {torch.get_num_threads()} threads, {args.rounds} rounds")
    for name, nbytes in (("now", now_bytes), ("then", then_bytes), ("read", now_bytes)):
        med = statistics.median(times[name])
        label = {"now": "working tree", "then": args.against, "read": "plain read (torch sum)"}[name]
        print(f"{label}: {med * 1e3:.2f} ms a pass, {nbytes / med / 1e9:.1f} GB/s")
    ratio = log_ratio_interval([a / b for a, b in zip(times["now"], times["then"])])
    print(f"time now / then: {ratio['point']:.3f} [{ratio['ci95'][0]:.3f}, {ratio['ci95'][1]:.3f}]")


if __name__ == "__main__":
    main()
