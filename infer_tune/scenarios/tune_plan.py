"""What `tune` tries, what it prunes before measuring, and how it judges what it measured.

Nothing here knows a technique: each one's registry entry says what `tune` may try of it (`tune=`,
tuners/base.py `Tuning`; docs/tune.md, "What a technique offers").
- `singles`: every entry's own offers for the search (`TuneAsk`): bases (most promising first by the
  speedup a host screen expects; pruned where the screen says they cannot win here, with the reason),
  single rows, and reference rows measured after the search. The screens' rows are the outcome's
  `kernel_screen`.
- `stack_candidates`: each entry's parts for a base that may win, stacked with it by the entry that
  composes stacks; `beside_method` splits them into those measured in the base's own rounds and
  those measured after it only if it may win.
- `judge`: whether a measured result may win (not broken, within the drift budget, lossless when
  required, faster than the baseline on the objective, no kernel slower than fp32), and why not.
- The serving objectives measure the parts whose technique ranks on them (batched stacks):
  `throughput` offers them the workload's prompts in one burst (capacity); `goodput` offers them a
  seeded Poisson trace at `TuneSpec.rate` and counts the requests per second that meet the SLOs (TTFT
  and TPOT), against the baseline serving the same trace one request at a time (scenarios/tune_goodput.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple

from infer_tune.document import ResultDocument, as_document
from infer_tune.metrics.saturation import SLO
from infer_tune.report.recommend import OBJECTIVES as OBJECTIVE_KEYS  # the key each objective is judged on
from infer_tune.tuners.base import Offer, TechniqueConfig, TuneAsk, tuning_entries

OBJECTIVES = ("decode", "ttft", "throughput", "goodput")


def tune_methods() -> tuple[str, ...]:
    """The names `--methods` chooses among: every registry entry's `Tuning.methods`, in registry order."""
    return tuple(m for entry in tuning_entries() for m in entry.tune.methods)


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
    meeting the SLOs); budget_s: wall-clock budget for the whole search; reference: measure the reference
    rows the registry offers (another engine on the same weights file) when they can run here; methods: the
    `--methods` names of the bases tried (None: all, `tune_methods`); compile: allow candidates that compile the decode step (minutes
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
    methods: tuple[str, ...] | None = None  # None: every method the registry offers
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
        if self.methods is not None:
            known = tune_methods()
            unknown = set(self.methods) - set(known)
            if unknown:
                raise ConfigError(f"tune: unknown methods {', '.join(sorted(unknown))}; choose from {', '.join(known)}")

    @property
    def slo(self) -> SLO:
        """The goodput objectives: TTFT from arrival and TPOT, in ms."""
        return SLO(ttft_ms=self.slo_ttft_ms, tpot_ms=self.slo_tpot_ms)

    def ask(self, host: Host | None = None, *, on: TechniqueConfig | None = None, first: bool = False) -> TuneAsk:
        """What a technique is told when asked for its offers (tuners/base.py `TuneAsk`)."""
        return TuneAsk(objective=self.objective, compile=self.compile, require_lossless=self.require_lossless,
                       budget_s=self.budget_s, methods=self.methods, reference=self.reference, rate=self.rate,
                       seed=self.seed,
                       loaded=host.loaded if host else None, prefill_rows=host.prefill_rows if host else 64,
                       prompt_tokens=host.prompt_tokens if host else (),
                       max_new_tokens=host.max_new_tokens if host else 128, on=on, first=first)


class Host(NamedTuple):
    """The machine-side facts a technique's offer may screen on: the loaded model, the prompts' median length,
    every prompt's length in tokens and the new tokens per request."""

    loaded: Any
    prefill_rows: int = 64
    prompt_tokens: tuple[int, ...] = ()
    max_new_tokens: int = 128


@dataclass
class Candidate:
    """One configuration `tune` considers (from a registry entry's `Offer`), and what became of it."""

    config: TechniqueConfig
    lossless: bool
    method: str | None = None  # the `--methods` name of the base it is or holds, if any
    base: bool = False  # offered as a base: its stacks are tried when it may win
    beside: bool = True  # a stack that may be measured in its base's own rounds (`beside_method`)
    estimate: float | None = None  # what its technique's host screen expects: speedup for the objective's regime
    estimate_ci95: list[float] | None = None  # its 95% interval over the screen's rounds (None: point timings)
    compiles: bool = False
    rounds_with: str | None = None  # queued candidates with the same tag are measured in one group of rounds
    status: str = "pending"  # measured | pruned | skipped | failed
    reason: str | None = None
    doc: ResultDocument | None = None
    eligible: bool = False
    within_budget: bool = False  # judged on everything but the objective: quality, lossless, kernels
    measured_at_s: float | None = None  # seconds into the search when its (last) measurement finished

    @property
    def label(self) -> str:
        return self.config.label()

    def summary(self) -> dict:
        doc = as_document(self.doc) if self.doc is not None else None
        m = doc.metrics if doc is not None else {}
        return {"label": self.label, "technique": self.config.technique, "config": self.config.to_dict(),
                "status": self.status, "eligible": self.eligible, "reason": self.reason,
                "measured_at_s": self.measured_at_s,
                "kernel_screen_speedup": self.estimate, "kernel_screen_speedup_ci95": self.estimate_ci95,
                "run_id": doc.run_id if doc is not None else None,
                "decode_tok_s": decode_tok_s(doc) if doc is not None else None,
                "ttft_p50_ms": doc.ttft_p50_ms if doc is not None else None,
                "speedup_vs_baseline": m.get("speedup_vs_baseline"), "ppl_delta_pct": m.get("ppl_delta_pct"),
                "bleu_drift": m.get("bleu_drift"), "exact_match_vs_baseline": m.get("exact_match_vs_baseline"),
                "broken": m.get("broken"), "noisy": doc.noisy if doc is not None else None,
                "goodput_req_s": m.get("goodput_req_s"), "slo_attainment": m.get("slo_attainment"),
                "goodput_ratio_vs_baseline": m.get("goodput_ratio_vs_baseline"),
                "goodput_ratio_vs_baseline_ci95": m.get("goodput_ratio_vs_baseline_ci95"),
                "baseline_goodput_req_s": (m.get("goodput_vs_baseline") or {}).get("baseline_goodput_req_s")}


def decode_tok_s(doc: ResultDocument) -> float | None:
    tpot = as_document(doc).tpot_p50_ms
    return 1000.0 / tpot if tpot else None


def score(doc: ResultDocument, objective: str) -> float | None:
    """Higher is better: decode tok/s, -TTFT p50, output tok/s, or good requests/s."""
    doc = as_document(doc)
    if objective == "decode":
        return decode_tok_s(doc)
    if objective == "ttft":
        ttft = doc.ttft_p50_ms
        return -ttft if ttft else None
    if objective == "goodput":
        return doc.metric("goodput_req_s")
    return doc.throughput_tok_s


# --------------------------------------------------------------------------- plan
def candidate(offer: Offer) -> Candidate:
    """A registry entry's offer as a `tune` candidate (pruned, with the reason, where the offer says so)."""
    cand = Candidate(offer.config, lossless=offer.lossless, method=offer.method, estimate=offer.estimate,
                     estimate_ci95=offer.estimate_ci95, compiles=offer.compiles, base=offer.role == "base",
                     beside=offer.beside)
    if offer.reason:
        cand.status, cand.reason = "pruned", offer.reason
    return cand


def offers(spec: TuneSpec, host: Host | None = None, *, on: TechniqueConfig | None = None,
           first: bool = False) -> list[tuple[Any, Offer]]:
    """(entry, offer) of every registry entry that offers `tune` something for this search, in registry order."""
    ask = spec.ask(host, on=on, first=first)
    return [(entry, o) for entry in tuning_entries() if entry.tune.offer for o in entry.tune.offer(ask)]


class Singles(NamedTuple):
    candidates: list[Candidate]
    screen: dict  # method -> its screen row on this host (`kernel_screen`)
    references: list[Offer]  # measured after the search, the winner compared with them


def singles(spec: TuneSpec, host: Host | None = None) -> Singles:
    """Every entry's own offers: the bases, most promising first (the speedup the screen expects; pruned ones
    last, with the reason), then the single rows, in registry order; with `require_lossless` only the
    offers that claim to be lossless. `host` None: planned without screening."""
    found = [o for _, o in offers(spec, host)]
    screen = {o.method: o.screen for o in found if o.method and o.screen is not None}
    cands = [candidate(o) for o in found if o.role in ("single", "base")
             and (o.lossless or not spec.require_lossless)]
    cands.sort(key=lambda c: (not c.base, c.base and c.status == "pruned", -(c.estimate or 0.0) if c.base else 0.0))
    return Singles(cands, screen, [o for o in found if o.role == "reference"])


def single_candidates(spec: TuneSpec, host: Host | None = None) -> list[Candidate]:
    """The candidates of `singles`."""
    return singles(spec, host).candidates


def may_stack(cand: Candidate, spec: TuneSpec) -> bool:
    """Whether a measured base gets its stacks: when it may win; for the goodput objective when it is within
    the budgets (its own closed-loop row serves no arrival trace, so has no goodput: its batched stacks are
    what is judged on it)."""
    return cand.eligible or (spec.objective == "goodput" and cand.within_budget)


def composer():
    """The registry's stack composer (`Tuning.compose`: parts -> one config), None when none is registered."""
    return next((e.tune.compose for e in tuning_entries() if e.tune.compose), None)


def stack_candidates(spec: TuneSpec, bases: list[Candidate], *, first: bool = True,
                     host: Host | None = None) -> list[Candidate]:
    """Every entry's parts for each base (`TuneAsk.on`; `first`: the first base stacked, which gets the
    parts that are costly to try), each stacked with its base by the registry's composer. Order: the parts
    that may go beside their base first, and among them those whose technique ranks on the search's own
    objective (batched stacks for throughput); a pair that cannot share a stack (the entries' `conflicts`)
    is left out."""
    from infer_tune.errors import ConfigError

    compose = composer()
    out: list[Candidate] = []
    if compose is None:
        return out
    for cand in bases:
        parts = [(e, o) for e, o in offers(spec, host, on=cand.config, first=first) if o.role == "part"]
        parts.sort(key=lambda eo: (not eo[1].beside, eo[0].objective != spec.objective))
        for _, part in parts:
            try:
                config = compose([cand.config, part.config])
            except ConfigError:
                continue
            out.append(Candidate(config, lossless=False, method=cand.method, estimate=cand.estimate,
                                 estimate_ci95=cand.estimate_ci95, compiles=part.compiles, beside=part.beside))
    return out


def beside_method(spec: TuneSpec, cand: Candidate, host: Host | None = None) -> tuple[list[Candidate], list[Candidate]]:
    """The stacks of the most promising base split in two: those measured in the same group of rounds as the
    base itself, before its own row says whether it may win, and the rest, measured after it only if it may
    win. Beside it go its likely winners (parts offered `beside`) that compile nothing (a native step,
    single-stream and, for the throughput objective, batched), so a leader stands before any compile is
    paid; its compiled ones follow as one group of their own rounds (`rounds_with`), then the parts not
    offered beside. Where none of the likely ones is cheap (or none compiles), they all go beside it. The
    group shares the baseline's passes, the slowest part of every round. Nothing beside it for the goodput
    objective (its batched stacks are judged on goodput keys taken one row at a time) or where there are no
    stacks (ttft)."""
    if spec.objective == "goodput":
        return [], []
    stacks = stack_candidates(spec, [cand], first=True, host=host)
    last = [s for s in stacks if not s.beside]
    likely = [s for s in stacks if s.beside]
    cheap = [s for s in likely if not s.compiles]
    compiled = [s for s in likely if s.compiles]
    if not cheap or not compiled:
        return likely, last
    for s in compiled:
        s.rounds_with = f"compiled stacks of {cand.label}"
    return cheap, compiled + last


# --------------------------------------------------------------------------- judging
@dataclass
class Judgement:
    eligible: bool
    reasons: list[str] = field(default_factory=list)
    within_budget: bool = False  # no reason but the objective's comparison with the baseline


def quality_reasons(m: dict, max_ppl_delta: float, max_bleu_drift: float) -> list[str]:
    """Why a row's quality is outside the budgets (perplexity change in %, BLEU drift in points); [] when
    within them or not measured. `tune` and `tune --engine` judge quality with it."""
    reasons = []
    ppl = m.get("ppl_delta_pct")
    if ppl is not None and ppl > max_ppl_delta:
        reasons.append(f"perplexity {ppl:+.2f}% exceeds the {max_ppl_delta:g}% budget")
    drift = m.get("bleu_drift")
    if drift is not None and drift < -max_bleu_drift:
        reasons.append(f"BLEU drift {drift:+.2f} exceeds the -{max_bleu_drift:g} budget")
    return reasons


def judge(doc: ResultDocument, spec: TuneSpec, *, lossless_claimed: bool) -> Judgement:
    """Whether a measured result may be chosen, and every reason it may not. On the objective it must beat
    the baseline with the whole 95% interval of its ratio (`OBJECTIVE_KEYS`); for goodput, at least one
    of its requests must also have met the SLOs (two rows that meet none compare durations, not goodput)."""
    doc = as_document(doc)
    m = doc.metrics
    reasons = []
    if m.get("broken"):
        reasons.append(f"broken: {m.get('broken_why')}")
    reasons += quality_reasons(m, spec.max_ppl_delta, spec.max_bleu_drift)
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
    ratio, ci = doc.metric(key), doc.interval(key)
    low = ci[0] if ci else ratio
    better = "more goodput than" if spec.objective == "goodput" else "faster than"
    if ratio is None:
        reasons.append("no goodput: it did not serve the arrival trace beside the baseline"
                       if spec.objective == "goodput" else f"no {key} measured")
    elif spec.objective == "goodput" and not m.get("good_requests"):
        reasons.append(f"no request met the SLOs ({slo_text(spec)})")
    elif low <= 1.0:
        shown = f" [{ci[0]:.2f}, {ci[1]:.2f}]" if ci else ""
        reasons.append(f"not {better} the baseline with its whole 95% interval ({key} {ratio:.2f}{shown})")
    return Judgement(eligible=not reasons, reasons=reasons, within_budget=within_budget)


def slo_text(spec: TuneSpec) -> str:
    return f"TTFT <= {spec.slo_ttft_ms:g} ms, TPOT <= {spec.slo_tpot_ms:g} ms"


def pick_winner(candidates: list[Candidate], baseline: ResultDocument, objective: str) -> ResultDocument:
    """The eligible measured result whose objective interval has the highest lower bound (its ratio
    against the baseline measured in the same rounds); the baseline when none is eligible."""
    return decide(candidates, baseline, objective)[0]


def decide(candidates: list[Candidate], baseline: ResultDocument,
           objective: str) -> tuple[ResultDocument, list[Candidate]]:
    """(winner, contenders): the winner as in `pick_winner`, and the eligible candidates whose interval
    reaches the winner's lower bound (the winner first; one entry when it is separated from the rest)."""
    from infer_tune.report.recommend import interval_of

    eligible = [c for c in candidates if c.eligible and c.doc is not None and interval_of(c.doc, objective)]
    if not eligible:
        return baseline, []
    best = max(eligible, key=lambda c: interval_of(c.doc, objective))
    low = interval_of(best.doc, objective)[0]
    return best.doc, [best] + [c for c in eligible if c is not best and interval_of(c.doc, objective)[2] >= low]
