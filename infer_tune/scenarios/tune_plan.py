"""What `tune` tries, what it prunes before measuring, and how it judges what it measured.

- `host_screen`: times every quantize method's candidate kernels (and bf16) on the model's own Linear
  shapes at decode (1 row) and prefill rows, interleaved with fp32 on the same shapes in shuffled
  rounds (the quantize kernel screen, tuners/quantize/screen.py). A method whose best kernel's 95%
  interval of its speedup over fp32 lies wholly below 1 for the objective's regime cannot win on this
  host and is pruned with that interval, before anything is quantized; one whose interval reaches 1 is
  measured (docs/architecture.md, "Decisions taken from intervals").
- `single_candidates` / `stack_candidates`: what is measured: quantize methods (the kernel screen's most
  promising first), the lossless lean path, and stacks of the methods that may win with the lean path.
- `judge`: whether a measured result may win (not broken, within the drift budget, lossless when
  required, faster than the baseline on the objective, no kernel slower than fp32), and why not.
- The serving objectives measure batched stacks (`batched_parts`): `throughput` offers them the
  workload's prompts in one burst (capacity); `goodput` offers them a seeded Poisson trace at
  `TuneSpec.rate` and counts the requests per second that meet the SLOs (TTFT and TPOT), against the
  baseline serving the same trace one request at a time (scenarios/tune_goodput.py).
"""

from __future__ import annotations

import functools
from collections import Counter
from dataclasses import dataclass, field

import torch
from torch import nn

from infer_tune.metrics.saturation import SLO
from infer_tune.report.recommend import OBJECTIVES as OBJECTIVE_KEYS  # the key each objective is judged on
from infer_tune.tuners.base import TechniqueConfig

OBJECTIVES = ("decode", "ttft", "throughput", "goodput")
# `-a8`: the method with int8 activations (QuantizeConfig.activations; the w4a8 kernel, infer_tune/native)
QUANT_METHODS = ("int4-rtn-a8", "int4-rtn", "int4-weight", "int8-dynamic", "int8-static", "bf16")
A8 = "-a8"


def quantize_config(method: str):
    """A tune method name -> its QuantizeConfig (`int4-rtn-a8`: int4-rtn with int8 activations)."""
    from infer_tune.tuners.quantize import QuantizeConfig

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
# --objective goodput: the load offered and the objectives a good request meets (the SLOs of the
# serving examples in docs/batch.md: SmolLM2 on a few CPU cores)
DEFAULT_RATE = 1.0  # requests/s
DEFAULT_SLO_TTFT_MS = 5000.0
DEFAULT_SLO_TPOT_MS = 500.0


@dataclass
class TuneSpec:
    """The search: drift budget, objective, time budget, and what may be tried.

    max_ppl_delta: largest perplexity change allowed, in percent; max_bleu_drift: largest BLEU loss
    allowed (points); require_lossless: only configs whose outputs equal the baseline's token for token;
    objective: decode (TPOT p50), ttft (TTFT p50), throughput (output tok/s) or goodput (requests/s
    meeting the SLOs); budget_s: wall-clock budget for the whole search; reference: measure llama.cpp at
    its best (its fastest format here, made from the same checkpoint) when it is built; compile: allow candidates that compile the decode step (minutes
    of compilation each). goodput only: rate (requests/s of the seeded Poisson trace), slo_ttft_ms and
    slo_tpot_ms (what a good request meets), seed (of the trace's arrivals and prompt order).
    """

    max_ppl_delta: float = 5.0
    max_bleu_drift: float = 1.0
    require_lossless: bool = False
    objective: str = "decode"
    budget_s: float = 1200.0
    reference: bool = True
    compile: bool = True
    methods: tuple[str, ...] = QUANT_METHODS
    rate: float = DEFAULT_RATE
    slo_ttft_ms: float = DEFAULT_SLO_TTFT_MS
    slo_tpot_ms: float = DEFAULT_SLO_TPOT_MS
    seed: int = 0

    def __post_init__(self) -> None:
        import math

        from infer_tune.errors import ConfigError

        if self.objective not in OBJECTIVES:
            raise ConfigError(f"tune: objective must be one of {', '.join(OBJECTIVES)}; got '{self.objective}'")
        if not (self.rate > 0 and math.isfinite(self.rate)):
            raise ConfigError(f"tune: rate must be a finite number > 0 requests/s; got {self.rate}")
        _ = self.slo  # the SLO checks its objectives: finite milliseconds > 0
        if not self.max_ppl_delta >= 0:
            raise ConfigError(f"tune: max_ppl_delta must be >= 0 (percent); got {self.max_ppl_delta}")
        if not self.max_bleu_drift >= 0:
            raise ConfigError(f"tune: max_bleu_drift must be >= 0 (BLEU points); got {self.max_bleu_drift}")
        if not self.budget_s > 0:
            raise ConfigError(f"tune: budget_s must be > 0; got {self.budget_s}")
        unknown = set(self.methods) - set(QUANT_METHODS)
        if unknown:
            raise ConfigError(f"tune: unknown methods {', '.join(sorted(unknown))}; choose from {', '.join(QUANT_METHODS)}")

    @property
    def slo(self) -> SLO:
        """The goodput objectives: TTFT from arrival and TPOT, in ms."""
        return SLO(ttft_ms=self.slo_ttft_ms, tpot_ms=self.slo_tpot_ms)


@dataclass
class Candidate:
    """One configuration `tune` considers, and what became of it."""

    config: TechniqueConfig
    lossless: bool
    method: str | None = None  # the quantize method it holds, if any
    estimate: float | None = None  # kernel screen: speedup of its Linears vs fp32 for the objective's regime
    estimate_ci95: list[float] | None = None  # its 95% interval over the screen's rounds (None: point timings)
    compiles: bool = False
    rounds_with: str | None = None  # queued candidates with the same tag are measured in one group of rounds
    status: str = "pending"  # measured | pruned | skipped | failed
    reason: str | None = None
    doc: dict | None = None
    eligible: bool = False
    within_budget: bool = False  # judged on everything but the objective: quality, lossless, kernels
    measured_at_s: float | None = None  # seconds into the search when its (last) measurement finished

    @property
    def label(self) -> str:
        return self.config.label()

    def summary(self) -> dict:
        m = (self.doc or {}).get("metrics", {})
        return {"label": self.label, "technique": self.config.technique, "config": self.config.to_dict(),
                "status": self.status, "eligible": self.eligible, "reason": self.reason,
                "measured_at_s": self.measured_at_s,
                "kernel_screen_speedup": self.estimate, "kernel_screen_speedup_ci95": self.estimate_ci95,
                "run_id": (self.doc or {}).get("run_id"),
                "decode_tok_s": decode_tok_s(self.doc) if self.doc else None,
                "ttft_p50_ms": (m.get("ttft_ms") or {}).get("p50"),
                "speedup_vs_baseline": m.get("speedup_vs_baseline"), "ppl_delta_pct": m.get("ppl_delta_pct"),
                "bleu_drift": m.get("bleu_drift"), "exact_match_vs_baseline": m.get("exact_match_vs_baseline"),
                "broken": m.get("broken"), "noisy": (m.get("noise") or {}).get("noisy"),
                "goodput_req_s": m.get("goodput_req_s"), "slo_attainment": m.get("slo_attainment"),
                "goodput_ratio_vs_baseline": m.get("goodput_ratio_vs_baseline"),
                "goodput_ratio_vs_baseline_ci95": m.get("goodput_ratio_vs_baseline_ci95"),
                "baseline_goodput_req_s": (m.get("goodput_vs_baseline") or {}).get("baseline_goodput_req_s")}


def decode_tok_s(doc: dict) -> float | None:
    tpot = ((doc.get("metrics") or {}).get("tpot_ms") or {}).get("p50")
    return 1000.0 / tpot if tpot else None


def score(doc: dict, objective: str) -> float | None:
    """Higher is better: decode tok/s, -TTFT p50, output tok/s, or good requests/s."""
    m = doc.get("metrics") or {}
    if objective == "decode":
        return decode_tok_s(doc)
    if objective == "ttft":
        ttft = (m.get("ttft_ms") or {}).get("p50")
        return -ttft if ttft else None
    if objective == "goodput":
        return m.get("goodput_req_s")
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


# --------------------------------------------------------------------------- plan
def single_candidates(spec: TuneSpec, screen: dict) -> list[Candidate]:
    """Quantize methods (most promising first; pruned ones carry the reason), then what every other
    technique's registry entry offers `tune` (`tune_candidates`: the lossless lean path, ...)."""
    from infer_tune.tuners.base import TECHNIQUES, load_techniques

    regime = "prefill" if spec.objective == "ttft" else "decode"
    out = []
    if not spec.require_lossless:
        for method in spec.methods:
            cand = Candidate(quantize_config(method), lossless=False, method=method,
                             estimate=screen.get(method, {}).get(regime),
                             estimate_ci95=screen.get(method, {}).get(f"{regime}_speedup_ci95"))
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


def may_stack(cand: Candidate, spec: TuneSpec) -> bool:
    """Whether a measured quantize candidate gets its stacks: when it may win; for the goodput objective
    when it is within the budgets (its own closed-loop row serves no arrival trace, so has no goodput:
    its batched stacks are what is judged on it)."""
    return cand.eligible or (spec.objective == "goodput" and cand.within_budget)


def stack_candidates(spec: TuneSpec, methods: list[Candidate], *, first: bool = True) -> list[Candidate]:
    """Stacks of measured quantize candidates that may win: with the lean decode path (and, for methods with
    int8 activations, its native step: no compile, so cheap to measure), and for the first
    also with the lean path's C++ wrapper (measured faster on some runs, slower on others here: so
    measured) and a static compiled cache through generate(); for the throughput objective first the
    batched stacks (`batched_parts`), for the goodput objective only those (a single stream serves the
    trace one request at a time, as the baseline does). None for the ttft objective (they speed decode)."""
    from infer_tune.tuners.kv_cache import KVCacheConfig
    from infer_tune.tuners.lean import LeanConfig
    from infer_tune.tuners.stack import StackConfig

    out = []
    if spec.objective == "ttft":
        return out
    for cand in methods:
        native = getattr(cand.config, "activations", None) == "int8" and native_step_runs()
        parts = [LeanConfig(compile=spec.compile)]
        if native:
            parts.append(LeanConfig(native_step=True))  # the whole step in one native call (no compile)
        if first and spec.compile:
            parts += [LeanConfig(compile=True, cpp_wrapper=True), KVCacheConfig(impl="static", compile=True)]
        if spec.objective == "throughput":  # serving many requests: the batched stacks come first
            parts[:0] = batched_parts(spec, native=native)
        elif spec.objective == "goodput":
            parts = batched_parts(spec, native=native)
        for part in parts:  # a native step compiles nothing (its C++ is built once, with the kernels)
            out.append(Candidate(StackConfig(configs=[cand.config, part]), lossless=False, method=cand.method,
                                 estimate=cand.estimate, estimate_ci95=cand.estimate_ci95,
                                 compiles=spec.compile and not getattr(part, "native_step", False)))
    return out


def native_step_runs() -> bool:
    """Whether the lean path's native step (infer_tune/native/step.py) can run here: its kernels build."""
    from infer_tune import native

    return native.available()[0]


def beside_method(spec: TuneSpec, cand: Candidate) -> tuple[list[Candidate], list[Candidate]]:
    """The stacks of the kernel screen's most promising quantize method split in two: those measured in the
    same group of rounds as the method itself, before its own row says whether it may win, and the rest,
    measured after it only if it may win. Beside it go its likely winners that compile nothing (the native
    step, single-stream and, for the throughput objective, batched), so a leader stands before any compile
    is paid; its compiled stacks (the lean decode path, with and without the C++ wrapper, and the compiled
    batched steps) follow as one group of their own rounds (`rounds_with`), then a static compiled cache
    through generate(). Where no stack runs natively, the compiled ones go beside it as before. The group
    shares the baseline's passes, the slowest part of every round. Nothing beside it for the goodput
    objective (its batched stacks are judged on goodput keys taken one row at a time) or where there are no
    stacks (ttft)."""
    from infer_tune.tuners.kv_cache import KVCacheConfig

    if spec.objective == "goodput":
        return [], []
    stacks = stack_candidates(spec, [cand], first=True)
    last = [s for s in stacks if isinstance(s.config.configs[-1], KVCacheConfig)]
    likely = [s for s in stacks if not isinstance(s.config.configs[-1], KVCacheConfig)]
    cheap = [s for s in likely if not s.compiles]
    compiled = [s for s in likely if s.compiles]
    if not cheap or not compiled:
        return likely, last
    for s in compiled:
        s.rounds_with = f"compiled stacks of {cand.label}"
    return cheap, compiled + last


BATCH_SLOTS = (4, 8)  # slots of the batched candidates (the reference serves 4 in parallel)
BURST_RATE = 1000.0  # requests/s: every request of the workload arrives at once, so a row measures capacity


def batched_parts(spec: TuneSpec, *, native: bool = False) -> list[TechniqueConfig]:
    """For the serving objectives: continuous batching on the lean slot engine (docs/batch.md), as many
    slots as BATCH_SLOTS. throughput: offered the workload's prompts in one burst, so the row's output
    tok/s is the stack's capacity (the baseline's is one request at a time); goodput: offered them as a
    seeded Poisson trace at `spec.rate` (one request per prompt, arrivals and order from `spec.seed`).
    The slot engine compiles its step: none when `spec.compile` is off. `native` (a method with int8
    activations, where the native kernels build): the same slots with the native step as well."""
    from infer_tune.tuners.batch import BatchConfig

    if not spec.compile:
        return []
    rate = spec.rate if spec.objective == "goodput" else BURST_RATE
    return [BatchConfig(scheduler="continuous", batch_size=n, rate=rate, engine="lean", seed=spec.seed,
                        native_step=step) for step in ((False, True) if native else (False,)) for n in BATCH_SLOTS]


# --------------------------------------------------------------------------- judging
@dataclass
class Judgement:
    eligible: bool
    reasons: list[str] = field(default_factory=list)
    within_budget: bool = False  # no reason but the objective's comparison with the baseline


def judge(doc: dict, spec: TuneSpec, *, lossless_claimed: bool) -> Judgement:
    """Whether a measured result may be chosen, and every reason it may not. On the objective it must beat
    the baseline with the whole 95% interval of its ratio (`OBJECTIVE_KEYS`); for goodput, at least one
    of its requests must also have met the SLOs (two rows that meet none compare durations, not goodput)."""
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
    within_budget = not reasons
    key = OBJECTIVE_KEYS[spec.objective]
    ratio, ci = m.get(key), m.get(f"{key}_ci95")
    low = ci[0] if isinstance(ci, list) and len(ci) == 2 else ratio
    better = "more goodput than" if spec.objective == "goodput" else "faster than"
    if ratio is None:
        reasons.append("no goodput: it did not serve the arrival trace beside the baseline"
                       if spec.objective == "goodput" else f"no {key} measured")
    elif spec.objective == "goodput" and not m.get("good_requests"):
        reasons.append(f"no request met the SLOs ({slo_text(spec)})")
    elif low <= 1.0:
        shown = f" [{ci[0]:.2f}, {ci[1]:.2f}]" if low is not ratio else ""
        reasons.append(f"not {better} the baseline with its whole 95% interval ({key} {ratio:.2f}{shown})")
    return Judgement(eligible=not reasons, reasons=reasons, within_budget=within_budget)


def slo_text(spec: TuneSpec) -> str:
    return f"TTFT <= {spec.slo_ttft_ms:g} ms, TPOT <= {spec.slo_tpot_ms:g} ms"


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
