"""The native decode step of a scaling preset, two ways, interleaved in one process: what a change to the step's
memory or kernels does at a real size, before a full `bench/scaling.py` run.

The model is built as bench/scaling.py builds it (`build_ours`: int4-rtn a8 at `--group-size`, layer by layer
from the preset's random checkpoint, or drawn from the seed for an `--ours-only` model), a plain static cache
prefilled with a 49-token prompt, then `--rounds` rounds (who goes first alternating) of `--steps` decode steps
of each side, each side's own LlamaStep on its own copy of the weights and the same cache:

- `--variant huge-pages`: the weights copied, in the order the step reads them, into one anonymous mapping
  whose start is 2 MiB-aligned and that is `madvise(MADV_HUGEPAGE)`d before its first touch (`place`: on a
  host whose transparent huge pages are `madvise`, 2 MiB pages; AnonHugePages in /proc/self/smaps_rollup
  shows them), against the same weights where torch allocated them (4 KiB pages there);
- `--variant profile`: per round the whole step, the head alone, every layer's seven w4a8 matmuls (one call
  each) and a plain read of the same weight bytes, each timed, with the GB/s each reads;
- `--against REV`: the working tree's step against the step at git revision REV (its C++ sources built into
  a library of their own, bench/native_ab.py), both on torch-allocated weights.

Prints each side's tokens per second (median), the 95% interval of the per-round time ratio (first / second),
the bytes of weights a step reads and the GB/s that makes, and AnonHugePages before and after.

    flock /tmp/infer-tune-cpu.lock .venv/bin/python bench/step_ab.py --model qwen3-4b --group-size 128

Not a test: read the ratios of one run.
"""

from __future__ import annotations

import argparse
import ctypes
import mmap
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

HUGE = 2 << 20  # a transparent huge page on x86-64 and arm64 with 4 KiB base pages
ALIGN = 64  # each tensor's start: a cache line
THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def thp_mode(path: Path = THP) -> str:
    """The host's transparent huge page mode (`always`, `madvise`, `never`), or `unavailable`."""
    try:
        text = path.read_text()
    except OSError:
        return "unavailable"
    chosen = [w[1:-1] for w in text.split() if w.startswith("[") and w.endswith("]")]
    return chosen[0] if chosen else "unavailable"


def anon_huge_bytes() -> int | None:
    """This process's anonymous memory on huge pages (`AnonHugePages` of /proc/self/smaps_rollup), None where unread."""
    try:
        for line in Path("/proc/self/smaps_rollup").read_text().splitlines():
            if line.startswith("AnonHugePages:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _address(buffer: mmap.mmap) -> int:
    view = ctypes.c_char.from_buffer(buffer)
    try:
        return ctypes.addressof(view)
    finally:
        del view  # releases the export (the mapping's address does not move)


def place(tensors: list[torch.Tensor]) -> dict:
    """Move `tensors` (distinct, contiguous, CPU) into one 2 MiB-aligned `MADV_HUGEPAGE` arena, in this order.
    Returns what was done: {"bytes", "tensors", "aligned", "advised", "thp"}; with THP `never` or unavailable
    (or no `madvise` in this Python) the tensors stay where they are and "advised" is False."""
    mode = thp_mode()
    sizes = [t.numel() * t.element_size() for t in tensors]
    total = 0
    offsets = []
    for n in sizes:
        offsets.append(total)
        total += -(-n // ALIGN) * ALIGN
    facts = {"bytes": total, "tensors": len(tensors), "thp": mode, "advised": False, "aligned": False}
    if not tensors or mode in ("never", "unavailable") or not hasattr(mmap, "MADV_HUGEPAGE"):
        return facts
    if any(t.device.type != "cpu" or not t.is_contiguous() for t in tensors):
        raise ValueError("huge pages: every tensor must be contiguous on the CPU")
    span = -(-total // HUGE) * HUGE
    arena = mmap.mmap(-1, span + HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS,
                      prot=mmap.PROT_READ | mmap.PROT_WRITE)
    start = (-_address(arena)) % HUGE  # the first 2 MiB boundary in the mapping (a multiple of the page size)
    arena.madvise(mmap.MADV_HUGEPAGE, start, span)  # before the first touch: the faults take 2 MiB pages
    flat = torch.frombuffer(arena, dtype=torch.uint8, offset=start, count=total)  # holds the mapping alive
    del arena
    with torch.no_grad():
        for t, offset, n in zip(tensors, offsets, sizes):
            copy = flat[offset:offset + n].view(t.dtype).view(t.shape)
            with torch.inference_mode(t.is_inference()):
                copy.copy_(t)
                t.set_(copy)
    facts.update(advised=True, aligned=flat.data_ptr() % HUGE == 0)
    return facts


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="qwen3-4b")
    p.add_argument("--group-size", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--variant", default="huge-pages", choices=("huge-pages", "profile"))
    p.add_argument("--against", default=None, help="a git revision whose step is the second side")
    p.add_argument("--ours-only", default="", help="models drawn from the seed (no checkpoint), comma-separated")
    args = p.parse_args()

    from bench.native_ab import interleaved
    from bench.scaling import build_ours
    from infer_tune.native.step import llama_step, plain_cache, recognize
    from infer_tune.scenarios.common import setup_threads

    warnings.filterwarnings("ignore")
    setup_threads(args.threads)
    started = time.monotonic()
    tokenizer, model, facts = build_ours(args.model, args.seed, set(args.ours_only.split(",")), args.group_size,
                                         screen=False)  # the kernels' defaults: w4a8, w8a8
    print(f"built {args.model} g{args.group_size} in {time.monotonic() - started:.0f} s", flush=True)
    parts, why = recognize(model)
    if parts is None:
        raise SystemExit(f"no native step: {why}")
    weights = [t for t in parts["tensors"] if t.numel()]
    step_bytes = sum(t.numel() * t.element_size() for t in weights)
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "Write a function that sorts a list in "
                                          "Python, explain how it works and how fast it is, with an example."}],
                                        add_generation_prompt=True, return_tensors="pt", return_dict=True)["input_ids"]
    prompt = ids.shape[1]
    cache = plain_cache(model.config, 640)
    with torch.inference_mode():
        model(input_ids=ids, past_key_values=cache, use_cache=True, cache_position=torch.arange(prompt))
    keys, values = [c.keys for c in cache.layers], [c.values for c in cache.layers]
    before = anon_huge_bytes()
    if args.variant == "profile":
        return profile(args, model, parts, first_layer_bytes(parts), keys, values, prompt)
    if args.against:
        from bench.native_ab import build_then

        build_then(args.against, Path(tempfile.mkdtemp(prefix="step-ab-")))
        first = llama_step(parts, keys, values)
        second = llama_step(parts, keys, values, cls=torch.classes.ab_native.AbLlamaStep)
        names = ("working tree", args.against)
    else:
        moved = [t.clone() for t in parts["tensors"]]
        placed = place([t for t in moved if t.numel()])
        print(f"huge pages: {placed}", flush=True)
        first = llama_step({**parts, "tensors": moved}, keys, values)
        second = llama_step(parts, keys, values)
        names = ("huge pages", "torch's allocation")
    after = anon_huge_bytes()
    with torch.inference_mode():
        x = model.get_input_embeddings()(torch.tensor([[42]])).reshape(1, -1)
        diff = float((first.step(x, prompt) - second.step(x, prompt)).abs().max())
    print(f"largest logit difference at the first step: {diff:.3g}", flush=True)

    def decode(step):
        def run():
            with torch.inference_mode():
                for i in range(args.steps):
                    step.step(x, prompt + 1 + i)
        return run
    a_ms, b_ms, ratio = interleaved(decode(first), decode(second), args.rounds)
    mib = step_bytes / 2**20
    for name, ms in zip(names, (a_ms, b_ms)):
        tok_s = args.steps * 1000 / ms
        print(f"{name}: {tok_s:.2f} tok/s ({ms / args.steps:.1f} ms a step, {step_bytes * tok_s / 1e9:.1f} GB/s "
              f"of {mib:.0f} MiB weights)")
    print(f"time ratio {names[0]} / {names[1]}: {ratio}")
    print(f"AnonHugePages: {before / 2**20:.0f} MiB before, {after / 2**20:.0f} MiB after "
          f"(THP {thp_mode()}); rounds {args.rounds} x {args.steps} steps, threads {torch.get_num_threads()}")


def first_layer_bytes(parts: dict) -> int:
    from infer_tune.native.step import PER_LAYER

    return sum(t.numel() * t.element_size() for t in parts["tensors"][:PER_LAYER])


def profile(args, model, parts, layer_bytes, keys, values, prompt) -> None:
    """`--variant profile`: per round, the whole step, the head's w8a8 alone, every layer's seven w4a8 matmuls
    (one call each), and a plain read of the same weight bytes (a sum over each tensor as int64), each timed;
    medians and the GB/s each part reads."""
    from infer_tune.native.step import PER_LAYER, llama_step

    ops = torch.ops.infer_tune_native
    layers, hidden = parts["ints"][0], parts["ints"][4]
    group, inter = parts["ints"][6], parts["ints"][5]
    tensors = parts["tensors"]
    head = tensors[layers * PER_LAYER + 1:]
    mats = [(tensors[layer * PER_LAYER + 1 + i], i) for layer in range(layers) for i in range(7)]
    step = llama_step(parts, keys, values)
    with torch.inference_mode():
        x = model.get_input_embeddings()(torch.tensor([[42]])).reshape(1, -1)
    rows = {"hidden": torch.randn(1, hidden), "inter": torch.randn(1, inter),
            "o": torch.randn(1, parts["ints"][1] * parts["ints"][3])}
    weights = [t for t in tensors if t.numel() and t.dtype in (torch.uint8, torch.int8)]
    bytes_of = {"step": sum(t.numel() * t.element_size() for t in tensors if t.numel()),
                "head": sum(t.numel() * t.element_size() for t in head),
                "matmuls": sum(t.numel() for t, _ in mats), "read": sum(t.numel() for t in weights)}

    def run_step():
        for i in range(args.steps):
            step.step(x, prompt + 1 + i)

    def run_head():
        for _ in range(args.steps):
            ops.w8a8_mm(rows["hidden"], *head) if len(head) == 2 else ops.w4a8_mm(rows["hidden"], head[0], parts["ints"][7])

    def run_matmuls():
        for _ in range(max(1, args.steps // 4)):
            for t, i in mats:
                ops.w4a8_mm(rows["inter" if i == 6 else "o" if i == 3 else "hidden"], t, group)

    def run_read():
        for _ in range(max(1, args.steps // 4)):
            for t in weights:
                t.view(torch.int64).sum() if t.numel() % 8 == 0 else t.sum()
    fns = {"step": (run_step, args.steps), "head": (run_head, args.steps),
           "matmuls": (run_matmuls, max(1, args.steps // 4)), "read": (run_read, max(1, args.steps // 4))}
    times = {k: [] for k in fns}
    with torch.inference_mode():
        for fn, _ in fns.values():
            fn()
        for r in range(args.rounds):
            order = list(fns) if r % 2 == 0 else list(fns)[::-1]
            for k in order:
                started = time.perf_counter_ns()
                fns[k][0]()
                times[k].append((time.perf_counter_ns() - started) / 1e6 / fns[k][1])

    for k, ms in times.items():
        med = statistics.median(ms)
        print(f"{k}: {med:.2f} ms a pass ({', '.join(f'{m:.1f}' for m in ms)}), {bytes_of[k] / 2**20:.0f} MiB, "
              f"{bytes_of[k] / med / 1e6:.1f} GB/s")
    print(f"one layer's tensors {layer_bytes / 2**20:.1f} MiB; threads {torch.get_num_threads()}")


if __name__ == "__main__":
    main()
