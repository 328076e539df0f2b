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
kernel, bf16 activations), `dequant` (fp32); int4-a8 (int8 activations per block of 32): `w4a8` (the
project's C++ kernel, infer_tune/native), `dequant` (the same activations, fp32 matmul); int8-a8 (the
head of those models): `w8a8`, `dequant`.

`TRACEABLE`: kernels torch.compile traces into its graph, per kind. int8-dynamic's fbgemm op is one
(a custom op, modules.fbgemm_linear_dynamic); int8-static's fbgemm op breaks the graph (and recompiles
per layer shape), so a compiled decode step swaps it for the fastest traceable candidate measured
(`make_traceable`).
"""

from __future__ import annotations

import functools
import os
import warnings

import torch

from infer_tune.tuners.quantize import screen

KERNELS: dict[str, tuple[str, ...]] = {  # quantized Linear kind -> its candidate kernels
    "int8-dynamic": ("fbgemm", "int_mm", "dequant"),
    "int8-static": ("fbgemm", "int_mm", "dequant"),
    "int4": ("int4pack", "dequant"),
    "int4-a8": ("w4a8", "dequant"),
    "int8-a8": ("w8a8", "dequant"),
}
FORCE_REDUCE_RANGE_ENV = "INFER_TUNE_INT8_REDUCE_RANGE"  # "1"/"0": simulate (or deny) a saturating host


TRACEABLE: dict[str, tuple[str, ...]] = {
    "int8-dynamic": ("fbgemm", "int_mm", "dequant", "fbgemm_rows"),
    "int8-static": ("int_mm", "dequant"),
    "int4": ("int4pack", "dequant"),
    "int4-a8": ("w4a8", "dequant"),
    "int8-a8": ("w8a8", "dequant"),
}


def family(method: str, activations: str = "bf16") -> str:
    """The quantized Linear kind a method produces (int4-weight and int4-rtn share one; with int8
    activations, `int4-a8`)."""
    if method.startswith("int4"):
        return "int4-a8" if activations == "int8" else "int4"
    return method


def prepack_int8(qweight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None):
    zero_points = torch.zeros(qweight.shape[0], dtype=torch.long)
    with warnings.catch_warnings():  # torch.ao deprecation notices are not ours to print
        warnings.simplefilter("ignore")
        qtensor = torch._make_per_channel_quantized_tensor(qweight, scale.double(), zero_points, 0)
        return torch.ops.quantized.linear_prepack(qtensor, bias)


# --------------------------------------------------------------------------- activation range
@functools.lru_cache(maxsize=1)
def saturation_probe() -> dict:
    """Run fbgemm's static int8 linear where int16 pair sums must saturate; measured, not looked up.

    Activations all 255 (scale 1, zero point 0) against weights all 127: every output is exactly
    255 * 127 * K. A path that sums u8 x s8 pairs in int16 clamps each pair at 32767 and comes out low.
    """
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
           vs_fp32: dict[str, list[float]] | None = None, unseparated: str | None = None) -> dict:
    """The kernel to run for one regime, from measured (or injected) timings.

    `timings_ms`: candidate -> time (median over rounds) of the model's Linears at that regime;
    `fp32_ms`: the same shapes in fp32; `vs_fp32`: candidate -> [median, low, high] of its per-round
    time over fp32's (screen.Screen.vs_fp32; None for point timings). `forced` names a kernel to use
    regardless (the config's choice); `unseparated` a kernel to keep when the screen did not separate the
    candidates (a caller's default; never a lower median alone); otherwise screen.pick. Slower than fp32:
    the interval's low end above 1 when there is an interval, else the point ratio.
    """
    usable = {k: v for k, v in timings_ms.items() if v is not None}
    vs_fp32 = {k: v for k, v in (vs_fp32 or {}).items() if k in usable} or None
    if forced is not None:
        chosen, why = forced, "forced by the config"
    elif unseparated in usable:
        chosen, why = unseparated, f"the screen did not separate {sorted(usable)}: {unseparated} kept"
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


def excluded(kind: str, regime: str) -> dict[str, str]:
    """Candidates not eligible for a regime on this host, and why (numerics, not speed)."""
    out = {}
    if kind == "int8-dynamic" and regime == "prefill":
        out["fbgemm"] = ("one activation scale per call is per tensor at prefill: an outlier token (attention "
                         "sinks) would flatten every other token's precision")
    if kind.startswith("int8") and saturation_probe().get("int_mm_saturates"):
        out["int_mm"] = "torch._int_mm saturates on this host (measured by the probe)"
    if kind in ("int4-a8", "int8-a8"):
        from infer_tune import native

        ok, why = native.available()
        if not ok:
            out["w4a8" if kind == "int4-a8" else "w8a8"] = why
    return out


