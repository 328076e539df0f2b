"""What `tune` tries of quantize: its methods, screened on this host's kernels first (docs/tune.md).

- `host_screen`: times every method's candidate kernels (and bf16) on the model's own Linear shapes at
  decode (1 row) and prefill rows, interleaved with fp32 on the same shapes in shuffled rounds (the
  kernel screen, screen.py). A method whose best kernel's 95% interval of its speedup over fp32 lies
  wholly below 1 for the objective's regime cannot win on this host and is pruned with that interval,
  before anything is quantized; one whose interval reaches 1 is measured (docs/architecture.md,
  "Decisions taken from intervals").
- `offer`: the methods as `tune` bases (the stacks of the first that may win are what usually wins),
  each with its screen row, its expected speedup and, when pruned, why.
"""

from __future__ import annotations

import functools
from collections import Counter

import torch
from torch import nn

from infer_tune.tuners.base import Offer, TuneAsk
from infer_tune.tuners.quantize.config import QuantizeConfig

# `-a8`: the method with int8 activations (QuantizeConfig.activations; the w4a8 kernel, infer_tune/native)
TUNE_METHODS = ("int4-rtn-a8", "int4-rtn", "int4-weight", "int8-dynamic", "int8-static", "bf16")
A8 = "-a8"


def quantize_config(method: str) -> QuantizeConfig:
    """A tune method name -> its QuantizeConfig (`int4-rtn-a8`: int4-rtn with int8 activations)."""
    if method.endswith(A8):
        return QuantizeConfig(method=method[:-len(A8)], activations="int8")
    return QuantizeConfig(method=method)


def method_kind(method: str) -> str:
    """The quantized Linear kind a tune method's layers are (what the kernel screen times)."""
    from infer_tune.tuners.quantize import kernels

    if method == "bf16":
        return "bf16"
    config = quantize_config(method)
    return kernels.family(config.method, config.activations)


def model_linear_shapes(model: nn.Module) -> Counter:
    """(in_features, out_features) of every Linear a quantize method would replace, plus the head."""
    from infer_tune.tuners.quantize.apply import targeted_linears

    shapes = Counter((m.in_features, m.out_features) for m in targeted_linears(model).values())
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if isinstance(head, nn.Linear):
        shapes[(head.in_features, head.out_features)] += 1
    return shapes


# per (kind, regime) of the host screen: at least screen.MIN_ROUNDS rounds, at most this many or seconds
# (the quantize screen's own defaults are 40 rounds / 5 s; tune screens up to 8 regimes before its budget)
SCREEN_LIMITS = {"max_rounds": 20, "budget_s": 2.0}


def dtype_screen(shapes: Counter, rows: int, dtype: torch.dtype, *, inner: int = 2, **limits):
    """F.linear over `shapes` at `rows` rows in `dtype` against fp32, in the quantize screen's interleaved
    rounds (screen.run; the candidate is named "bf16"): the bf16 method's screen."""
    from infer_tune.tuners.quantize import kernel_choice, screen

    layers = []
    for (k, n), count in shapes.items():
        x, w = torch.randn(rows, k), torch.randn(n, k)
        layers.append((count, {screen.FP32: (x, w), "bf16": (x.to(dtype), w.to(dtype))}))

    def measure(name: str) -> float:
        return sum(count * kernel_choice.best_ms(functools.partial(torch.nn.functional.linear, *pair[name]), inner)
                   for count, pair in layers)

    with torch.inference_mode():
        for name in (screen.FP32, "bf16"):  # warm both paths once
            measure(name)
        return screen.run(measure, [screen.FP32, "bf16"], **limits)


def _speedup_interval(vs_fp32: list[float] | None) -> tuple[float, list[float]] | None:
    """(point, [low, high]) of fp32's time over the kernel's from the screen's [median, low, high] of the
    kernel's per-round time over fp32's (above 1: faster than fp32)."""
    if not vs_fp32 or not all(v and v > 0 for v in vs_fp32):
        return None
    mid, low, high = vs_fp32
    return 1.0 / mid, [1.0 / high, 1.0 / low]


def host_screen(model: nn.Module, methods: tuple[str, ...], prefill_rows: int, *, timings: dict | None = None) -> dict:
    """Method -> {decode: speedup vs fp32, decode_speedup_ci95: [low, high], prefill: ..., kernels: {regime:
    best kernel}} on this host.

    Each (kind, regime) is timed by the quantize kernel screen (kernel_choice.screen_kernels; bf16 by
    `dtype_screen`): every candidate and fp32 once per round, order shuffled per round, within
    SCREEN_LIMITS. The best kernel is the one quantize would choose (kernels.choose: the fastest by
    median unless its interval says slower than fp32 while another's does not); its speedup is fp32's
    time over its own with the 95% interval of the per-round ratio. `timings` injects {(kind, regime):
    screen.Screen (per-round samples) or (kernel -> ms, fp32 ms) point timings} (tests; a saturating or
    slow host); point timings give no interval (`*_speedup_ci95` None).
    """
    from infer_tune.tuners.quantize import kernel_choice, kernels

    shapes = model_linear_shapes(model)
    timings = {} if timings is None else timings
    out: dict[str, dict] = {}
    for method in methods:
        kind = method_kind(method)
        row: dict = {"kernels": {}}
        for regime, rows in (("decode", 1), ("prefill", prefill_rows)):
            if (kind, regime) not in timings:
                timings[(kind, regime)] = (dtype_screen(shapes, rows, torch.bfloat16, **SCREEN_LIMITS)
                                           if kind == "bf16" else
                                           kernel_choice.screen_kernels(shapes, rows, kind, **SCREEN_LIMITS))
            kernel_ms, fp32_ms, stats = kernel_choice.unpack_timing(timings[(kind, regime)])
            skip = kernels.excluded(kind, regime) if kind != "bf16" else {}
            usable = {k: v for k, v in kernel_ms.items() if v is not None and k not in skip}
            choice = kernels.choose(usable, fp32_ms, vs_fp32=(stats or {}).get("vs_fp32_ci95")) if usable else None
            best = choice["chosen"] if choice else None
            ci = _speedup_interval((choice.get("vs_fp32_ci95") or {}).get(best)) if choice else None
            row[regime] = ci[0] if ci else (fp32_ms / usable[best] if best and usable[best] else None)
            row[f"{regime}_speedup_ci95"] = ci[1] if ci else None
            row[f"{regime}_rounds"] = stats["rounds"] if stats else None
            row["kernels"][regime] = best
            row[f"{regime}_ms"], row[f"{regime}_fp32_ms"] = (usable.get(best) if best else None), fp32_ms
        out[method] = row
    return out


def prune_reason(screen_row: dict, objective: str) -> str | None:
    """Why a method cannot win on this host (None: keep it): its best kernel for the objective's regime is
    slower than fp32 with the whole 95% interval of its speedup below 1. An interval that reaches 1 keeps
    it (measured, not guessed); point timings (no interval) are judged on the point and say so."""
    regime = "prefill" if objective == "ttft" else "decode"
    speedup = screen_row.get(regime)
    if speedup is None:
        return f"no {regime} kernel runs on this host"
    ci = screen_row.get(f"{regime}_speedup_ci95")
    if ci is not None:
        if ci[1] >= 1.0:
            return None
        evidence = (f"95% interval of its speedup over fp32 [{ci[0]:.2f}, {ci[1]:.2f}] wholly below 1, "
                    f"{screen_row.get(f'{regime}_rounds')} interleaved rounds")
    elif speedup < 1.0:
        evidence = "point timings, no interval"
    else:
        return None
    return (f"its best {regime} kernel ({screen_row['kernels'][regime]}) is {1 / speedup:.2f}x slower than fp32 "
            f"on this model's shapes here ({evidence}; {screen_row[f'{regime}_ms']:.2f} vs "
            f"{screen_row[f'{regime}_fp32_ms']:.2f} ms)")


def method_offers(methods: tuple[str, ...], objective: str, screen: dict) -> list[Offer]:
    """Each method as a `tune` base with its screen row: the speedup the screen expects for the objective's
    regime and its interval, pruned (with the reason) where it cannot win here."""
    regime = "prefill" if objective == "ttft" else "decode"
    out = []
    for method in methods:
        row = screen.get(method)
        out.append(Offer(quantize_config(method), role="base", method=method, screen=row,
                         estimate=(row or {}).get(regime), estimate_ci95=(row or {}).get(f"{regime}_speedup_ci95"),
                         reason=prune_reason(row, objective) if row else None))
    return out


def offer(ask: TuneAsk) -> list[Offer]:
    """Quantize's offer to `tune`: every chosen method as a base (none to stack on another's row), screened
    on the host's kernels when a model is given (`host_screen`)."""
    if ask.on is not None:
        return []
    methods = TUNE_METHODS if ask.methods is None else tuple(m for m in ask.methods if m in TUNE_METHODS)
    screen = host_screen(ask.loaded.model, methods, ask.prefill_rows) if ask.loaded is not None and methods else {}
    return method_offers(methods, ask.objective, screen)
