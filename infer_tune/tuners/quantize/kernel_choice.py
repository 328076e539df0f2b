"""Kernel choice for a whole model: the model's quantized Linear shapes screened per kind and regime
(`screen_kernels`, interleaved rounds: screen.py), the choice applied to every layer, and the swaps a
compiled step needs (`make_traceable`). The kernels themselves, the activation range and the choice
rule on timings live in kernels.py; the layers in modules.py.
"""

from __future__ import annotations

import functools
import time
from collections import Counter

import torch
from torch import nn

from infer_tune.tuners.quantize import screen
from infer_tune.tuners.quantize.kernels import (
    KERNELS,
    TRACEABLE,
    activation_qmax,
    activation_range,
    choose,
    excluded,
    family,
)
from infer_tune.tuners.quantize.modules import LINEAR_KINDS


def linear_shapes(model: nn.Module) -> dict[str, Counter]:
    """Quantized Linear kind -> Counter of (in_features, out_features) -> how many layers have it."""
    shapes: dict[str, Counter] = {}
    for m in model.modules():
        if isinstance(m, tuple(LINEAR_KINDS.values())):
            shapes.setdefault(m.kind, Counter())[(m.in_features, m.out_features)] += 1
    return shapes


def best_ms(fn, reps: int) -> float:
    """Best of `reps` timed calls of `fn`, in milliseconds (the kernel screen's point figure for a shape)."""
    times = []
    for _ in range(reps):
        start = time.perf_counter_ns()
        fn()
        times.append(time.perf_counter_ns() - start)
    return min(times) / 1e6  # the best of a couple within a round: another process only ever adds time


def sample_module(kind: str, k: int, n: int, group_size: int) -> nn.Module:
    """A quantized layer of `kind` with random weights of shape [n, k] (for timing only)."""
    from infer_tune.tuners.quantize import modules

    gen = torch.Generator().manual_seed(k * 7919 + n)
    weight = torch.randn(n, k, generator=gen) * 0.02
    if kind in ("int4", "int4-a8"):
        from infer_tune.tuners.quantize.apply import int4_quantize

        t = int4_quantize(weight, group_size, hqq=False)
        return modules.LINEAR_KINDS[kind](t["qweight_int4"], t["scale"], t["zero"], group_size)
    q, scale = modules.int8_per_channel(weight)
    if kind == "int8-a8":
        return modules.Int8A8Linear(q, scale)
    if kind == "int8-static":
        return modules.Int8StaticLinear(q, scale, None, None, 0.05, 128 if activation_qmax() == 255 else 64)
    return modules.Int8DynamicLinear(q, scale)


SCREEN_ROWS = 8192  # the most output rows of a shape the screen holds (screen_kernels)


def screen_kernels(shapes: Counter, rows: int, kind: str, *, group_size: int = 32, inner: int = 2,
                   seed: int = 0, candidates: tuple[str, ...] | None = None, **limits) -> screen.Screen:
    """Time every candidate kernel of `kind` and fp32 on the model's Linear shapes of that kind at `rows`
    rows, in interleaved rounds (screen.run; `limits`: min_rounds, max_rounds, budget_s). `candidates`:
    the kernels to time (default: every kernel of the kind, KERNELS).

    One sample of a candidate is the per-step cost of those Linears: each distinct shape timed (best of
    `inner` calls) and weighted by how many layers have it. One layer per distinct shape is held for
    the whole screen, with at most SCREEN_ROWS output rows: a wider shape (a 128k-token head) is timed on
    its first SCREEN_ROWS rows and its time scaled by its rows over those (every kernel's time is linear in
    the output rows; without the cap the fp32 reference of a 1B model's head alone is 1 GB, and a first
    load that screens peaked at 4x the served model's memory).
    """
    layers = []
    for (k, n), count in shapes.items():
        timed = min(n, SCREEN_ROWS)
        x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
        layers.append((count * n / timed, sample_module(kind, k, timed, group_size), x, torch.randn(timed, k)))

    def measure(name: str) -> float:
        total = 0.0
        for weight, module, x, w in layers:
            if name == screen.FP32:
                call = functools.partial(torch.nn.functional.linear, x, w)
            else:
                module.set_kernels(name, name)
                call = functools.partial(module, x)
            total += weight * best_ms(call, inner)
        return total

    names = [screen.FP32, *(KERNELS[kind] if candidates is None else candidates)]
    with torch.inference_mode():
        for name in names:  # warm every path once (first calls allocate, pack)
            try:
                measure(name)
            except RuntimeError:  # a kernel this build / CPU does not provide: screen.run drops it
                pass
        return screen.run(measure, names, seed=seed, **limits)


def benchmark(shapes: Counter, rows: int, kind: str, *, group_size: int = 32,
              **limits) -> tuple[dict[str, float | None], float]:
    """(kernel -> median ms over interleaved rounds, None for a kernel that fails here; fp32 median ms)."""
    return screen_kernels(shapes, rows, kind, group_size=group_size, **limits).timings()


def _host_key() -> dict:
    """What a screen's timings depend on besides the shapes: the CPU, its flags, torch and its threads."""
    import platform

    from infer_tune import native

    model = next((line.split(":", 1)[1].strip() for line in _cpuinfo().splitlines()
                  if line.startswith("model name")), platform.processor())
    return {"cpu": model, "flags": native.all_cpu_flags(), "torch": torch.__version__,
            "threads": torch.get_num_threads(), "machine": platform.machine()}


def _cpuinfo() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return f.read()
    except OSError:
        return ""


def screen_path(kind: str, shapes: Counter, rows: int, group_size: int):
    """Where the screen of these shapes on this host is kept ($INFER_TUNE_HOME/kernels/screens/<digest>.json)."""
    import hashlib
    import json

    from infer_tune import paths

    key = json.dumps({"host": _host_key(), "kind": kind, "rows": rows, "group_size": group_size,
                      "shapes": sorted([list(shape), count] for shape, count in shapes.items())}, sort_keys=True)
    return paths.home() / "kernels" / "screens" / f"{hashlib.sha256(key.encode()).hexdigest()[:24]}.json"


def load_screen(path) -> screen.Screen | None:
    """A screen this host measured earlier (kept by `store_screen`); None when absent, unreadable, or in a folder
    another account could have written (paths.untrusted)."""
    import json

    from infer_tune import paths

    if not path.is_file() or paths.untrusted(path) is not None:
        return None
    try:
        data = json.loads(path.read_text())
        return screen.Screen(samples={k: [float(x) for x in v] for k, v in data["samples"].items()},
                             failed=list(data.get("failed") or []), rounds=int(data.get("rounds") or 0),
                             separated=bool(data.get("separated")), stopped=str(data.get("stopped") or ""))
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def store_screen(path, measured: screen.Screen) -> None:
    from dataclasses import asdict

    from infer_tune import atomic, paths

    try:
        paths.private_dir(path.parent)
        atomic.write_json(path, asdict(measured))
    except OSError:  # a read-only or full home: the next load measures again
        pass


def unpack_timing(value) -> tuple[dict[str, float | None], float, dict | None]:
    """A timings entry: a Screen (measured here) or an injected (kernel -> ms, fp32 ms) pair."""
    if isinstance(value, screen.Screen):
        kernel_ms, fp32_ms = value.timings()
        return kernel_ms, fp32_ms, value.record()
    kernel_ms, fp32_ms = value
    return kernel_ms, fp32_ms, None


def choose_for_model(model: nn.Module, method: str, *, prefill_rows: int = 64, group_size: int = 32,
                     forced: tuple[str | None, str | None] = (None, None),
                     timings: dict | None = None, activations: str = "bf16", keep: str | None = None) -> dict:
    """Measure and apply the decode and prefill kernels of every quantized Linear of `model`, per kind.

    An int8-static model also holds int8-dynamic Linears (its head, layers whose static error was too
    large); each kind gets its own choice. `forced` = (decode, prefill) kernel names from the config for
    the method's own kind (`family(method, activations)`; None: choose); `timings` holds benchmark results {(kind, regime): (kernel ->
    ms, fp32 ms)}: given ones are used instead of measuring (tests inject them), missing ones are
    measured and stored there (a run reuses them across configs). `keep`: "store" keeps each screen measured
    under $INFER_TUNE_HOME/kernels/screens (keyed by the host, torch, its threads, the kind, rows and shapes);
    "reuse" also takes a kept one instead of measuring (loading a saved model: its screen holds the full-size
    fp32 reference of every shape, a transient of 3.4 GB at 1B). Returns the record of the result.
    """
    shapes = linear_shapes(model)
    if not shapes:
        return {}
    own = family(method, activations)
    timings = {} if timings is None else timings
    record: dict = {"prefill_rows": prefill_rows, "by_kind": {}}
    totals = {"decode": [0.0, 0.0], "prefill": [0.0, 0.0]}
    for kind, kind_shapes in shapes.items():
        force = forced if kind == own else (None, None)
        chosen = {}
        for regime, rows, name in (("decode", 1, force[0]), ("prefill", prefill_rows, force[1])):
            if (kind, regime) not in timings:
                path = screen_path(kind, kind_shapes, rows, group_size) if keep else None
                kept = load_screen(path) if keep == "reuse" else None
                if kept is not None:
                    record.setdefault("screens_reused", []).append(f"{kind} {regime}")
                timings[(kind, regime)] = kept or screen_kernels(kind_shapes, rows, kind, group_size=group_size)
                if kept is None and path is not None and isinstance(timings[(kind, regime)], screen.Screen):
                    store_screen(path, timings[(kind, regime)])
            kernel_ms, fp32_ms, stats = unpack_timing(timings[(kind, regime)])
            skip = excluded(kind, regime)
            choice = choose({k: v for k, v in kernel_ms.items() if k not in skip}, fp32_ms, forced=name,
                            vs_fp32=(stats or {}).get("vs_fp32_ci95"))
            if skip:
                choice["excluded"] = skip
            if stats:
                choice.update(rounds=stats["rounds"], separated=stats["separated"], stopped=stats["stopped"])
            chosen[regime] = choice
            totals[regime][0] += choice["timings_ms"].get(choice["chosen"]) or kernel_ms.get(choice["chosen"]) or 0.0
            totals[regime][1] += fp32_ms
        apply_kernels(model, chosen["decode"]["chosen"], chosen["prefill"]["chosen"], kind=kind)
        record["by_kind"][kind] = chosen
    for regime, (ms, fp32_ms) in totals.items():
        ratio = fp32_ms / ms if ms else None
        choices = [v[regime] for v in record["by_kind"].values()]
        slower = ratio is not None and ratio < 1.0
        if slower and all("vs_fp32_ci95" in c for c in choices):  # screened: an interval must say so too
            slower = any(c["slower_than_fp32"] for c in choices)
        record[regime] = {"ms": ms, "fp32_ms": fp32_ms, "speedup_vs_fp32": ratio, "slower_than_fp32": slower,
                          "chosen": {k: v[regime]["chosen"] for k, v in record["by_kind"].items()}}
    if any(k in ("int8-dynamic", "int8-static") for k in shapes):  # fbgemm's uint8 activations
        record["activation_range"] = activation_range()
    return record


def apply_kernels(model: nn.Module, decode: str, prefill: str, *, kind: str | None = None) -> int:
    """Set the decode / prefill kernel of the quantized Linears of `model` (of `kind`, or all); returns how many."""
    n = 0
    for module in model.modules():
        if isinstance(module, tuple(LINEAR_KINDS.values())) and (kind is None or module.kind == kind):
            module.set_kernels(decode, prefill)
            n += 1
    return n


def make_traceable(model: nn.Module, record: dict | None = None) -> dict:
    """Swap every non-traceable kernel (fbgemm) of `model` for a traceable one, per kind and regime.

    The replacement is the fastest traceable candidate in `record` (the model's kernel record, its
    measured timings) when there is one, else `int_mm`. Returns {kind: {regime: (old, new)}} of what changed.
    """
    by_kind = (record or {}).get("by_kind") or {}
    changed: dict = {}
    for module in model.modules():
        if not isinstance(module, tuple(LINEAR_KINDS.values())):
            continue
        picks = []
        for regime, current in (("decode", module.decode_kernel), ("prefill", module.prefill_kernel)):
            if current in TRACEABLE[module.kind]:
                picks.append(current)
                continue
            timings = ((by_kind.get(module.kind) or {}).get(regime) or {}).get("timings_ms") or {}
            usable = {k: v for k, v in timings.items() if k in TRACEABLE[module.kind] and k in module.KERNELS and v is not None
                      and k not in excluded(module.kind, regime)}
            new = min(usable, key=usable.get) if usable else "int_mm"
            picks.append(new)
            changed.setdefault(module.kind, {})[regime] = (current, new)
        module.set_kernels(*picks)
    return changed
