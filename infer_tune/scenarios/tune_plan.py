"""What `tune` tries, what it prunes before measuring, and how it judges what it measured.

- `host_screen`: times every quantize method's candidate kernels (and bf16) on the model's own Linear
  shapes at decode (1 row) and prefill rows, against fp32 on the same shapes. A method whose best
  kernel is slower than fp32 for the objective's regime cannot win on this host and is pruned with
  the measured reason, before anything is quantized.
- `single_candidates` / `stack_candidates`: what is measured: quantize methods (the kernel screen's most
  promising first), the lossless lean path, and stacks of the methods that may win with the lean path.
- `judge`: whether a measured result may win (not broken, within the drift budget, lossless when
  required, faster than the baseline on the objective, no kernel slower than fp32), and why not.
"""

from __future__ import annotations

import functools
from collections import Counter
from dataclasses import dataclass, field

import torch
from torch import nn

from infer_tune.tuners.base import TechniqueConfig

OBJECTIVES = ("decode", "ttft", "throughput")
QUANT_METHODS = ("int4-rtn", "int4-weight", "int8-dynamic", "int8-static", "bf16")


@dataclass
class TuneSpec:
    """The search: drift budget, objective, time budget, and what may be tried.

    max_ppl_delta: largest perplexity change allowed, in percent; max_bleu_drift: largest BLEU loss
    allowed (points); require_lossless: only configs whose outputs equal the baseline's token for token;
    objective: decode (TPOT p50), ttft (TTFT p50) or throughput (output tok/s); budget_s: wall-clock
    budget for the whole search; reference: measure llama.cpp on the same GGUF when it is installed;
    compile: allow candidates that compile the decode step (minutes of compilation each).
    """

    max_ppl_delta: float = 5.0
    max_bleu_drift: float = 1.0
    require_lossless: bool = False
    objective: str = "decode"
    budget_s: float = 1200.0
    reference: bool = True
    compile: bool = True
    methods: tuple[str, ...] = QUANT_METHODS

    def __post_init__(self) -> None:
        from infer_tune.errors import ConfigError

        if self.objective not in OBJECTIVES:
            raise ConfigError(f"tune: objective must be one of {', '.join(OBJECTIVES)}; got '{self.objective}'")
        if not self.max_ppl_delta >= 0:
            raise ConfigError(f"tune: max_ppl_delta must be >= 0 (percent); got {self.max_ppl_delta}")
        if not self.max_bleu_drift >= 0:
            raise ConfigError(f"tune: max_bleu_drift must be >= 0 (BLEU points); got {self.max_bleu_drift}")
        if not self.budget_s > 0:
            raise ConfigError(f"tune: budget_s must be > 0; got {self.budget_s}")
        unknown = set(self.methods) - set(QUANT_METHODS)
        if unknown:
            raise ConfigError(f"tune: unknown methods {', '.join(sorted(unknown))}; choose from {', '.join(QUANT_METHODS)}")


@dataclass
class Candidate:
    """One configuration `tune` considers, and what became of it."""

    config: TechniqueConfig
    lossless: bool
    method: str | None = None  # the quantize method it holds, if any
    estimate: float | None = None  # kernel screen: speedup of its Linears vs fp32 for the objective's regime
    compiles: bool = False
    status: str = "pending"  # measured | pruned | skipped | failed
    reason: str | None = None
    doc: dict | None = None
    eligible: bool = False

    @property
    def label(self) -> str:
        return self.config.label()

    def summary(self) -> dict:
        m = (self.doc or {}).get("metrics", {})
        return {"label": self.label, "technique": self.config.technique, "config": self.config.to_dict(),
                "status": self.status, "eligible": self.eligible, "reason": self.reason,
                "kernel_screen_speedup": self.estimate, "run_id": (self.doc or {}).get("run_id"),
                "decode_tok_s": decode_tok_s(self.doc) if self.doc else None,
                "ttft_p50_ms": (m.get("ttft_ms") or {}).get("p50"),
                "speedup_vs_baseline": m.get("speedup_vs_baseline"), "ppl_delta_pct": m.get("ppl_delta_pct"),
                "bleu_drift": m.get("bleu_drift"), "exact_match_vs_baseline": m.get("exact_match_vs_baseline"),
                "broken": m.get("broken"), "noisy": (m.get("noise") or {}).get("noisy")}


def decode_tok_s(doc: dict) -> float | None:
    tpot = ((doc.get("metrics") or {}).get("tpot_ms") or {}).get("p50")
    return 1000.0 / tpot if tpot else None


def score(doc: dict, objective: str) -> float | None:
    """Higher is better: decode tok/s, -TTFT p50, or output tok/s."""
    m = doc.get("metrics") or {}
    if objective == "decode":
        return decode_tok_s(doc)
    if objective == "ttft":
        ttft = (m.get("ttft_ms") or {}).get("p50")
        return -ttft if ttft else None
    return m.get("output_throughput_tok_s")


# --------------------------------------------------------------------------- host screen
def model_linear_shapes(model: nn.Module) -> Counter:
    """(in_features, out_features) of every Linear a quantize method would replace, plus the head."""
    from infer_tune.tuners.quantize.apply import targeted_linears

    shapes = Counter((m.in_features, m.out_features) for m in targeted_linears(model).values())
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if isinstance(head, nn.Linear):
        shapes[(head.in_features, head.out_features)] += 1
    return shapes


def _best_ms(fn, reps: int = 5) -> float:
    from infer_tune.tuners.quantize.kernel_choice import _best_ms as best

    return best(fn, reps)


def dtype_ms(shapes: Counter, rows: int, dtype: torch.dtype) -> float:
    """Time of F.linear over `shapes` at `rows` rows in `dtype` (the bf16 screen)."""
    total = 0.0
    with torch.inference_mode():
        for (k, n), count in shapes.items():
            x, w = torch.randn(rows, k, dtype=dtype), torch.randn(n, k, dtype=dtype)
            total += count * _best_ms(functools.partial(torch.nn.functional.linear, x, w))
    return total


def host_screen(model: nn.Module, methods: tuple[str, ...], prefill_rows: int, *, timings: dict | None = None) -> dict:
    """Method -> {decode: speedup vs fp32, prefill: ..., kernels: {regime: best kernel}} on this host.

    `timings` injects {(kind, regime): (kernel -> ms, fp32 ms)} (tests; a saturating or slow host).
    """
    from infer_tune.tuners.quantize import kernel_choice, kernels

    shapes = model_linear_shapes(model)
    timings = {} if timings is None else timings
    out: dict[str, dict] = {}
    for method in methods:
        if method == "bf16":
            if ("bf16", "decode") not in timings:
                for regime, rows in (("decode", 1), ("prefill", prefill_rows)):
                    timings[("bf16", regime)] = ({"bf16": dtype_ms(shapes, rows, torch.bfloat16)},
                                                 dtype_ms(shapes, rows, torch.float32))
        kind = "bf16" if method == "bf16" else kernels.family(method)
        row: dict = {"kernels": {}}
        for regime, rows in (("decode", 1), ("prefill", prefill_rows)):
            if (kind, regime) not in timings:
                timings[(kind, regime)] = kernel_choice.benchmark(shapes, rows, kind)
            kernel_ms, fp32_ms = timings[(kind, regime)]
            skip = kernels.excluded(kind, regime) if kind != "bf16" else {}
            usable = {k: v for k, v in kernel_ms.items() if v is not None and k not in skip}
            best = min(usable, key=usable.get) if usable else None
            row[regime] = fp32_ms / usable[best] if best and usable[best] else None
            row["kernels"][regime] = best
            row[f"{regime}_ms"], row[f"{regime}_fp32_ms"] = (usable.get(best) if best else None), fp32_ms
        out[method] = row
    return out


def prune_reason(screen_row: dict, objective: str) -> str | None:
    """Why a method cannot win on this host (None: keep it). Its regime's Linears slower than fp32."""
    regime = "prefill" if objective == "ttft" else "decode"
    speedup = screen_row.get(regime)
    if speedup is None:
        return f"no {regime} kernel runs on this host"
    if speedup < 1.0:
        return (f"its best {regime} kernel ({screen_row['kernels'][regime]}) is {1 / speedup:.2f}x slower than fp32 "
                f"on this model's shapes here ({screen_row[f'{regime}_ms']:.2f} vs {screen_row[f'{regime}_fp32_ms']:.2f} ms)")
    return None


# --------------------------------------------------------------------------- plan
def single_candidates(spec: TuneSpec, screen: dict) -> list[Candidate]:
    """Quantize methods (most promising first; pruned ones carry the reason), then what every other
    technique's registry entry offers `tune` (`tune_candidates`: the lossless lean path, ...)."""
    from infer_tune.tuners.base import TECHNIQUES, load_techniques
    from infer_tune.tuners.quantize import QuantizeConfig

    regime = "prefill" if spec.objective == "ttft" else "decode"
    out = []
    if not spec.require_lossless:
        for method in spec.methods:
            cand = Candidate(QuantizeConfig(method=method), lossless=False, method=method,
                             estimate=screen.get(method, {}).get(regime))
            reason = prune_reason(screen[method], spec.objective) if method in screen else None
            if reason:
                cand.status, cand.reason = "pruned", reason
            out.append(cand)
        out.sort(key=lambda c: (c.status == "pruned", -(c.estimate or 0.0)))
    load_techniques()
    for entry in list(TECHNIQUES.values()):
        for config, attrs in (entry.tune_candidates(spec) if entry.tune_candidates else []):
            if spec.require_lossless and not attrs.get("lossless"):
                continue
            out.append(Candidate(config, lossless=bool(attrs.get("lossless")), compiles=bool(attrs.get("compiles"))))
    return out


def stack_candidates(spec: TuneSpec, methods: list[Candidate], *, first: bool = True) -> list[Candidate]:
    """Stacks of measured quantize candidates that may win: with the lean decode path, and for the first
    also with the lean path's C++ wrapper (measured faster on some runs, slower on others here: so
    measured) and a static compiled cache through generate(). None for the ttft objective (they
    speed decode)."""
    from infer_tune.tuners.kv_cache import KVCacheConfig
    from infer_tune.tuners.lean import LeanConfig
    from infer_tune.tuners.stack import StackConfig

    out = []
    if spec.objective == "ttft":
        return out
    for cand in methods:
        parts = [LeanConfig(compile=spec.compile)]
        if first and spec.compile:
            parts += [LeanConfig(compile=True, cpp_wrapper=True), KVCacheConfig(impl="static", compile=True)]
        for part in parts:
            out.append(Candidate(StackConfig(configs=[cand.config, part]), lossless=False, method=cand.method,
                                 estimate=cand.estimate, compiles=spec.compile))
    return out


# --------------------------------------------------------------------------- judging
@dataclass
class Judgement:
    eligible: bool
    reasons: list[str] = field(default_factory=list)


def judge(doc: dict, spec: TuneSpec, *, lossless_claimed: bool) -> Judgement:
    """Whether a measured result may be chosen, and every reason it may not."""
    m = doc.get("metrics") or {}
    reasons = []
    if m.get("broken"):
        reasons.append(f"broken: {m.get('broken_why')}")
    ppl = m.get("ppl_delta_pct")
    if ppl is not None and ppl > spec.max_ppl_delta:
        reasons.append(f"perplexity {ppl:+.2f}% exceeds the {spec.max_ppl_delta:g}% budget")
    drift = m.get("bleu_drift")
    if drift is not None and drift < -spec.max_bleu_drift:
        reasons.append(f"BLEU drift {drift:+.2f} exceeds the -{spec.max_bleu_drift:g} budget")
    exact = m.get("exact_match_vs_baseline")
    if spec.require_lossless and not (exact == 1.0):
        reasons.append(f"not lossless: {exact:.0%} of outputs match the baseline" if exact is not None
                       else "not lossless: no outputs to compare")
    if lossless_claimed and exact is not None and exact < 1.0 and not spec.require_lossless:
        reasons.append(f"claims lossless but {1 - exact:.0%} of outputs differ from the baseline")
    kernels = m.get("kernels") or {}
    regime = "prefill" if spec.objective == "ttft" else "decode"
    if (kernels.get(regime) or {}).get("slower_than_fp32"):
        reasons.append(f"its {regime} kernels are slower than fp32 on this host")
    key = {"decode": "speedup_vs_baseline", "ttft": "ttft_speedup_vs_baseline",
           "throughput": "throughput_ratio_vs_baseline"}[spec.objective]
    ratio, ci = m.get(key), m.get(f"{key}_ci95")
    low = ci[0] if isinstance(ci, list) and len(ci) == 2 else ratio
    if ratio is None or low <= 1.0:
        shown = f" [{ci[0]:.2f}, {ci[1]:.2f}]" if low is not ratio else ""
        reasons.append(f"not faster than the baseline with its whole 95% interval ({key} {ratio:.2f}{shown})"
                       if ratio is not None else f"no {key} measured")
    return Judgement(eligible=not reasons, reasons=reasons)


def pick_winner(candidates: list[Candidate], baseline: dict, objective: str) -> dict:
    """The eligible measured result whose objective interval has the highest lower bound (its ratio
    against the baseline measured in the same rounds); the baseline when none is eligible."""
    return decide(candidates, baseline, objective)[0]


def decide(candidates: list[Candidate], baseline: dict, objective: str) -> tuple[dict, list[Candidate]]:
    """(winner, contenders): the winner as in `pick_winner`, and the eligible candidates whose interval
    reaches the winner's lower bound (the winner first; one entry when it is separated from the rest)."""
    from infer_tune.report.recommend import interval_of

    eligible = [c for c in candidates if c.eligible and c.doc is not None and interval_of(c.doc, objective)]
    if not eligible:
        return baseline, []
    best = max(eligible, key=lambda c: interval_of(c.doc, objective))
    low = interval_of(best.doc, objective)[0]
    return best.doc, [best] + [c for c in eligible if c is not best and interval_of(c.doc, objective)[2] >= low]
