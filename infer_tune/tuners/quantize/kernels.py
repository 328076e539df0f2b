"""Kernels and numerics chosen on the host, by measuring: never by CPU name or a flag table.

Two decisions, both recorded in the result (`metrics.kernels`):

- **Activation range.** fbgemm multiplies uint8 activations by int8 weights in pairs whose sums
  are held in int16 on CPUs without VNNI (`vpmaddubsw` saturates at 32767: 2 x 255 x 127 does not
  fit). `saturation_probe()` runs the real static int8 kernel on inputs where a saturating path
  must go wrong; if it does, activations use the reduced range 0..127 (what torch's x86 qconfigs
  call `reduce_range`), otherwise the full 0..255.
- **GEMM kernel per regime.** Decode (one row) and prefill (many rows) each get the fastest of the
  candidate kernels for the method, timed on the model's own Linear shapes against an fp32 matmul
  of the same shapes, in interleaved rounds until the fastest is separated by its 95% interval
  (screen.py: the rounds, the stopping rule, and why a kernel whose interval says slower than fp32
  is not chosen while one that is not exists). A regime whose chosen kernel is still slower than
  fp32 is reported as such (`slower_than_fp32`), and `tune` never chooses it. The intervals are
  recorded (`vs_fp32_ci95`, `rounds`, `separated`).

Candidates (numerics noted where they differ): int8-dynamic: `fbgemm` (activation scale per call:
per token at decode, per tensor at prefill), `int_mm` (per-token int8 x int8 -> int32, torch._int_mm),
`dequant` (the int8 weight dequantized per call, fp32 matmul: weight-only numerics);
int8-static: `fbgemm` (calibrated scale, int8 GEMM), `int_mm` (the same grid through torch._int_mm),
`dequant` (the same activation grid, fake-quantized, fp32 matmul); int4: `int4pack` (torch's int4 CPU
kernel, bf16 activations), `dequant` (fp32).

`TRACEABLE`: kernels torch.compile traces into its graph, per kind. int8-dynamic's fbgemm op is one
(a custom op, modules.fbgemm_linear_dynamic); int8-static's fbgemm op breaks the graph (and recompiles
per layer shape), so a compiled decode step swaps it for the fastest traceable candidate measured
(`make_traceable`).
"""

from __future__ import annotations

import functools
import os
import time
import warnings
from collections import Counter

import torch
from torch import nn

from infer_tune.tuners.quantize import screen

KERNELS: dict[str, tuple[str, ...]] = {  # quantized Linear kind -> its candidate kernels
    "int8-dynamic": ("fbgemm", "int_mm", "dequant"),
    "int8-static": ("fbgemm", "int_mm", "dequant"),
    "int4": ("int4pack", "dequant"),
}
FORCE_REDUCE_RANGE_ENV = "INFER_TUNE_INT8_REDUCE_RANGE"  # "1"/"0": simulate (or deny) a saturating host


TRACEABLE: dict[str, tuple[str, ...]] = {
    "int8-dynamic": ("fbgemm", "int_mm", "dequant"),
    "int8-static": ("int_mm", "dequant"),
    "int4": ("int4pack", "dequant"),
}


def family(method: str) -> str:
    """The quantized Linear kind a method produces (int4-weight and int4-rtn share one)."""
    return "int4" if method.startswith("int4") else method


# --------------------------------------------------------------------------- activation range
@functools.lru_cache(maxsize=1)
def saturation_probe() -> dict:
    """Run fbgemm's static int8 linear where int16 pair sums must saturate; measured, not looked up.

    Activations all 255 (scale 1, zero point 0) against weights all 127: every output is exactly
    255 * 127 * K. A path that sums u8 x s8 pairs in int16 clamps each pair at 32767 and comes out low.
    """
    from infer_tune.tuners.quantize.modules import prepack_int8

    k, n = 64, 8
    qweight = torch.full((n, k), 127, dtype=torch.int8)
    packed = prepack_int8(qweight, torch.ones(n), None)
    x = torch.full((2, k), 255.0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = torch.ops.quantized.linear_with_input_q_dq_qweight_dq_output_fp32(x, 1.0, 0, packed)
    exact = 255.0 * 127.0 * k
    measured = float(out.flatten()[0])
    result = {"exact": exact, "measured": measured, "saturates": abs(measured - exact) > 1e-3 * exact}
    try:  # symmetric s8 x s8 through torch._int_mm (oneDNN shifts s8 to u8 internally on some paths)
        a = torch.full((32, k), 127, dtype=torch.int8)
        b = torch.full((k, 32), 127, dtype=torch.int8)
        got = float(torch._int_mm(a, b)[0, 0])
        result["int_mm_saturates"] = abs(got - 127.0 * 127.0 * k) > 1e-3 * 127.0 * 127.0 * k
    except RuntimeError:
        result["int_mm_saturates"] = None
    return result


def activation_range() -> dict:
    """{qmax, reduce_range, why, probe}: the uint8 activation range this host's int8 GEMM holds."""
    forced = os.environ.get(FORCE_REDUCE_RANGE_ENV)
    probe = saturation_probe()
    if forced in ("0", "1"):
        reduce = forced == "1"
        why = f"forced by {FORCE_REDUCE_RANGE_ENV}={forced} (probe measured saturation: {probe['saturates']})"
    else:
        reduce = probe["saturates"]
        why = ("probe: u8 x s8 pair sums saturate int16 here (no VNNI path), activations use 0..127"
               if reduce else "probe: full-range u8 x s8 products are exact here (VNNI-class int8 dot products)")
    return {"qmax": 127 if reduce else 255, "reduce_range": reduce, "why": why, "probe": probe}


def reduce_range() -> bool:
    return activation_range()["reduce_range"]


def activation_qmax() -> int:
    return activation_range()["qmax"]


# --------------------------------------------------------------------------- choice
def choose(timings_ms: dict[str, float], fp32_ms: float, *, forced: str | None = None,
           vs_fp32: dict[str, list[float]] | None = None) -> dict:
    """The kernel to run for one regime, from measured (or injected) timings.

    `timings_ms`: candidate -> time (median over rounds) of the model's Linears at that regime;
    `fp32_ms`: the same shapes in fp32; `vs_fp32`: candidate -> [median, low, high] of its per-round
    time over fp32's (screen.Screen.vs_fp32; None for point timings). `forced` names a kernel to use
    regardless (the config's choice); otherwise screen.pick. Slower than fp32: the interval's low end
    above 1 when there is an interval, else the point ratio.
    """
    usable = {k: v for k, v in timings_ms.items() if v is not None}
    vs_fp32 = {k: v for k, v in (vs_fp32 or {}).items() if k in usable} or None
    if forced is not None:
        chosen, why = forced, "forced by the config"
    elif usable:
        chosen, why = screen.pick(usable, vs_fp32)
    else:
        raise ValueError("no kernel timings to choose from")
    chosen_ms = usable.get(chosen)
    ratio = fp32_ms / chosen_ms if chosen_ms else None
    if vs_fp32 and chosen in vs_fp32:
        slower = vs_fp32[chosen][1] > 1.0
    else:
        slower = ratio is not None and ratio < 1.0
    if slower:
        why += f"; still {1 / ratio:.2f}x slower than fp32 on these shapes"
    out = {"chosen": chosen, "why": why, "timings_ms": timings_ms, "fp32_ms": fp32_ms,
           "speedup_vs_fp32": ratio, "slower_than_fp32": slower}
    if vs_fp32:
        out["vs_fp32_ci95"] = vs_fp32
    return out


def linear_shapes(model: nn.Module) -> dict[str, Counter]:
    """Quantized Linear kind -> Counter of (in_features, out_features) -> how many layers have it."""
    from infer_tune.tuners.quantize.modules import LINEAR_KINDS

    shapes: dict[str, Counter] = {}
    for m in model.modules():
        if isinstance(m, tuple(LINEAR_KINDS.values())):
            shapes.setdefault(m.kind, Counter())[(m.in_features, m.out_features)] += 1
    return shapes


def _best_ms(fn, reps: int) -> float:
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
    if kind == "int4":
        from infer_tune.tuners.quantize.apply import int4_quantize

        t = int4_quantize(weight, group_size, hqq=False)
        return modules.Int4Linear(t["qweight_int4"], t["scale"], t["zero"], group_size)
    q, scale = modules.int8_per_channel(weight)
    if kind == "int8-static":
        return modules.Int8StaticLinear(q, scale, None, None, 0.05, 128 if activation_qmax() == 255 else 64)
    return modules.Int8DynamicLinear(q, scale)


def screen_kernels(shapes: Counter, rows: int, kind: str, *, group_size: int = 32, inner: int = 2,
                   seed: int = 0, **limits) -> screen.Screen:
    """Time every candidate kernel of `kind` and fp32 on the model's Linear shapes of that kind at `rows`
    rows, in interleaved rounds (screen.run; `limits`: min_rounds, max_rounds, budget_s).

    One sample of a candidate is the per-step cost of those Linears: each distinct shape timed (best of
    `inner` calls) and weighted by how many layers have it. One layer per distinct shape is held for
    the whole screen (a few hundred MB for a 7B model's shapes, in fp32 for the reference).
    """
    layers = []
    for (k, n), count in shapes.items():
        x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
        layers.append((count, sample_module(kind, k, n, group_size), x, torch.randn(n, k)))

    def measure(name: str) -> float:
        total = 0.0
        for count, module, x, w in layers:
            if name == screen.FP32:
                call = functools.partial(torch.nn.functional.linear, x, w)
            else:
                module.set_kernels(name, name)
                call = functools.partial(module, x)
            total += count * _best_ms(call, inner)
        return total

    with torch.inference_mode():
        for name in (screen.FP32, *KERNELS[kind]):  # warm every path once (first calls allocate, pack)
            try:
                measure(name)
            except RuntimeError:  # a kernel this build / CPU does not provide: screen.run drops it
                pass
        return screen.run(measure, [screen.FP32, *KERNELS[kind]], seed=seed, **limits)


def benchmark(shapes: Counter, rows: int, kind: str, *, group_size: int = 32,
              **limits) -> tuple[dict[str, float | None], float]:
    """(kernel -> median ms over interleaved rounds, None for a kernel that fails here; fp32 median ms)."""
    return screen_kernels(shapes, rows, kind, group_size=group_size, **limits).timings()


def _unpack(value) -> tuple[dict[str, float | None], float, dict | None]:
    """A timings entry: a Screen (measured here) or an injected (kernel -> ms, fp32 ms) pair."""
    if isinstance(value, screen.Screen):
        kernel_ms, fp32_ms = value.timings()
        return kernel_ms, fp32_ms, value.record()
    kernel_ms, fp32_ms = value
    return kernel_ms, fp32_ms, None


def excluded(kind: str, regime: str) -> dict[str, str]:
    """Candidates not eligible for a regime on this host, and why (numerics, not speed)."""
    out = {}
    if kind == "int8-dynamic" and regime == "prefill":
        out["fbgemm"] = ("one activation scale per call is per tensor at prefill: an outlier token (attention "
                         "sinks) would flatten every other token's precision")
    if kind.startswith("int8") and saturation_probe().get("int_mm_saturates"):
        out["int_mm"] = "torch._int_mm saturates on this host (measured by the probe)"
    return out


def choose_for_model(model: nn.Module, method: str, *, prefill_rows: int = 64, group_size: int = 32,
                     forced: tuple[str | None, str | None] = (None, None),
                     timings: dict | None = None) -> dict:
    """Measure and apply the decode and prefill kernels of every quantized Linear of `model`, per kind.

    An int8-static model also holds int8-dynamic Linears (its head, layers whose static error was too
    large); each kind gets its own choice. `forced` = (decode, prefill) kernel names from the config for
    the method's own kind (None: choose); `timings` holds benchmark results {(kind, regime): (kernel ->
    ms, fp32 ms)}: given ones are used instead of measuring (tests inject them), missing ones are
    measured and stored there (a run reuses them across configs). Returns the record of the result.
    """
    shapes = linear_shapes(model)
    if not shapes:
        return {}
    own = family(method)
    timings = {} if timings is None else timings
    record: dict = {"prefill_rows": prefill_rows, "by_kind": {}}
    totals = {"decode": [0.0, 0.0], "prefill": [0.0, 0.0]}
    for kind, kind_shapes in shapes.items():
        force = forced if kind == own else (None, None)
        chosen = {}
        for regime, rows, name in (("decode", 1, force[0]), ("prefill", prefill_rows, force[1])):
            if (kind, regime) not in timings:
                timings[(kind, regime)] = screen_kernels(kind_shapes, rows, kind, group_size=group_size)
            kernel_ms, fp32_ms, stats = _unpack(timings[(kind, regime)])
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
    if any(k.startswith("int8") for k in shapes):
        record["activation_range"] = activation_range()
    return record


def apply_kernels(model: nn.Module, decode: str, prefill: str, *, kind: str | None = None) -> int:
    """Set the decode / prefill kernel of the quantized Linears of `model` (of `kind`, or all); returns how many."""
    from infer_tune.tuners.quantize.modules import LINEAR_KINDS

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
    from infer_tune.tuners.quantize.modules import LINEAR_KINDS

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
