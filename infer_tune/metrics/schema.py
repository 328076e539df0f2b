"""What `metrics` of a result document may hold: a typed core every measured row shares, and one declared
namespace per technique (`Technique.metric_keys`), per engine (`Engine.metric_keys`) and for the sweep
(`SWEEP_KEYS`: figures over every row of a sweep, its conclusion). The JSON layout stays flat: a namespace
says who may add a key, not where it is written. `Metrics` is the read-only view a document gives its
readers; only `ResultDocument`'s methods add to it (docs/architecture.md, "Result documents").
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from typing import Any

# ----------------------------------------------------------------------------------------- the typed core
# What sweep.document.build_document writes on every measured row (timing, memory, roofline, quality and the
# deltas against the baseline: metrics/deltas.py), key -> what it is.
DISTRIBUTIONS = {
    "ttft_ms": "time to first token per request, ms (metrics.stats.summarize: n, p50, p90, p99, mean, ...)",
    "tpot_ms": "time per output token after the first, per request, ms",
    "itl_ms": "gaps between consecutive tokens, ms",
    "e2e_ms": "request start to its last token, ms",
    "queue_ms": "time a request waited for a scheduler, ms (rows whose runner queues)",
}
CORE: dict[str, str] = {
    **DISTRIBUTIONS,
    "output_throughput_tok_s": "output tokens per second of the whole run",
    "request_throughput_req_s": "requests per second of the whole run",
    "rounds": "the interleaved rounds block (document.RoundsBlock)",
    "noise": "the host's noise figure (metrics.noise.figure)",
    "roofline_tok_s": "tokens/s a decode streaming weights + KV cache at the ceiling would reach",
    "roofline_fraction": "decode tokens/s over roofline_tok_s",
    "roofline_fraction_ci95": "its interval over the rounds",
    "roofline_fraction_by_round": "the fraction per round",
    "roofline_refused": "why the fraction is not a result (above the ceiling), else null",
    "roofline_bandwidth_gb_s": "the ceiling's read bandwidth, GB/s",
    "roofline_bandwidth_from": "where that ceiling was read",
    "decode_tok_s": "achieved decode tokens/s (1000 / TPOT p50 x batch)",
    "peak_rss_bytes": "peak resident memory of the process",
    "rss_before_bytes": "resident memory before the run",
    "peak_rss_delta_bytes": "peak minus before",
    "cuda_peak_bytes": "peak accelerator memory",
    "model_bytes": "bytes of the weights that ran",
    "extra_model_bytes": "bytes beyond the model's own parameters (a draft's weights, packed tensors)",
    "first_call_ms": "the first generate call, ms",
    "warmup_s": "warm-up seconds",
    "iterations": "measured iterations",
    "generated_tokens": "output tokens generated in the measured iterations",
    "bleu": "BLEU against the references", "chrf": "chrF against the references",
    "bleu_tokenizer": "sacrebleu's tokenizer",
    "ppl": "perplexity of the references", "ppl_stderr": "its standard error", "ppl_source": "who measured it",
    "pass_at_1": "code suite pass@1", "pass_at_1_isolation": "sandbox or unsafe",
    "pass_at_1_memory_limit": "the tests' memory limit",
    "ranks": "per-rank figures of a multi-process run",
    "quality": "why quality figures are null (random weights)",
    "generate_steps": "steps of the generate loop (or deliveries an endpoint's client saw): the runner's count",
    # against the baseline (metrics/deltas.py versus_baseline)
    "speedup_vs_baseline": "baseline TPOT p50 / this row's", "speedup_vs_baseline_ci95": "its interval",
    "ttft_speedup_vs_baseline": "baseline TTFT p50 / this row's", "ttft_speedup_vs_baseline_ci95": "its interval",
    "throughput_ratio_vs_baseline": "output tokens/s over the baseline's",
    "throughput_ratio_vs_baseline_ci95": "its interval",
    "bleu_drift": "BLEU minus the baseline's", "bleu_drift_ci95": "its paired interval",
    "pass_at_1_delta": "pass@1 minus the baseline's", "ppl_delta_pct": "perplexity change against the baseline, %",
    "bleu_vs_baseline": "BLEU of the outputs against the baseline's",
    "exact_match_vs_baseline": "share of outputs equal to the baseline's",
    "first_divergence_token": "mean first token where a differing output differs",
    "output_mismatches": "outputs that differ (the runner's own count where it keeps one)",
    "output_mismatches_vs_baseline": "outputs that differ from the baseline's",
    "broken": "the verdict: quality damaged", "broken_why": "why", "verdict_evidence": "the facts it rests on",
}

# ----------------------------------------------------------------------------------------- the sweep's own
# Keys over every row of a sweep (a technique's `conclude`, a command's `SweepPlan.conclude` or admission):
# stored in the sweep's conclusion, set again when the sweep sees more rows; never a figure of one row's own.
SWEEP_KEYS: dict[str, str] = {
    "claim_check": "the claim judged on every row of the sweep (report/claims.py reads it)",
    "knee_batch_size": "the batch-size sweep's knee", "is_knee": "this row is the knee",
    "max_rate_meeting_slo": "the highest offered rate whose rows met the SLOs",
    "goodput_req_s": "requests/s that met the SLOs", "slo_attainment": "share of requests meeting the SLOs",
    "good_requests": "requests meeting the SLOs", "slo": "the SLOs judged",
    "memory_limit_bytes": "the command's memory limit", "exceeded_memory_limit": "the row's peak went over it",
    "predicted_peak_bytes": "the admission's predicted peak memory",
    "baseline_skipped": "the admission skipped the plain baseline (why)",
    "compared_with": "what the row is compared with, when not the plain baseline (the admission's)",
    "slo_attainment_by_objective": "share of requests meeting each SLO",
    "goodput_ratio_vs_baseline": "goodput over the baseline's serving the same trace one request at a time",
    "goodput_ratio_vs_baseline_ci95": "its interval over the rounds",
    "goodput_vs_baseline": "how that ratio was taken (scenarios/tune_goodput.py)",
    "offered_rate_req_s": "the offered request rate of a rate sweep's row",
    "saturated": "the rate sweep found this rate saturated the server",
    "sweep_rates": "the rates of the rate sweep", "knee_rate_req_s": "the rate sweep's knee",
    "knee_factor": "the knee's criterion", "knee_status": "whether the knee was found",
}

NAMESPACE_SWEEP = "sweep"


class UndeclaredMetricError(KeyError):
    """A source would add a metric key that is neither a core figure nor declared by its namespace."""

    def __str__(self) -> str:  # KeyError quotes its argument; this one is a sentence
        return str(self.args[0])


# how a technique's declared keys are found: set by tuners/base.py (the registry sits above this module)
_technique_keys: Callable[[str], Mapping[str, str] | None] | None = None


def set_technique_keys(lookup: Callable[[str], Mapping[str, str] | None]) -> None:
    """Where `technique_keys` reads a registered technique's `metric_keys` (tuners/base.py calls it on import)."""
    global _technique_keys
    _technique_keys = lookup


def technique_keys(name: str) -> dict[str, str]:
    """The keys technique `name` declares (`Technique.metric_keys`; a row kind's, ROW_KINDS; {} for an unknown
    name)."""
    if name in ROW_KINDS:
        return dict(ROW_KINDS[name])
    found = _technique_keys(name) if _technique_keys is not None else None
    return dict(found or {})


def engine_keys(name: str | None) -> dict[str, str]:
    """The keys engine `name` declares (`Engine.metric_keys`; {} for an unknown name or None)."""
    if name is None:
        return {}
    from infer_tune.engines.base import ENGINES

    entry = ENGINES.get(name)
    return dict(entry.metric_keys) if entry is not None else {}


def declared(namespaces: Iterable[str]) -> set[str]:
    """Every key the named namespaces declare: `sweep`, `engine:<name>` or a technique's name."""
    keys: set[str] = set()
    for space in namespaces:
        if space == NAMESPACE_SWEEP:
            keys |= set(SWEEP_KEYS)
        elif space.startswith("engine:"):
            keys |= set(engine_keys(space.split(":", 1)[1]))
        else:
            keys |= set(technique_keys(space))
    return keys


def check_declared(keys: Iterable[str], namespaces: Iterable[str], source: str) -> None:
    """UndeclaredMetricError naming `source` and the keys that are neither core figures nor declared by one of
    `namespaces` (a technique's name, `engine:<name>`, `sweep`)."""
    spaces = list(namespaces)
    allowed = set(CORE) | declared(spaces)
    unknown = sorted(k for k in keys if k not in allowed)
    if unknown:
        raise UndeclaredMetricError(
            f"{source} adds metric(s) {', '.join(unknown)} that are neither core figures (metrics/schema.py CORE) "
            f"nor declared by {' or '.join(spaces) or 'any namespace'} (declare them in the technique's or engine's "
            "`metric_keys`, or in SWEEP_KEYS)")


def finite(value: Any) -> float | None:
    """A finite float, else None (a bool is not a number here)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    value = float(value)
    return value if math.isfinite(value) else None


def _read_only(self, *args, **kwargs):
    raise TypeError("a result's metrics are read-only: add them through the ResultDocument's methods "
                    "(add_metrics, set_sweep_metrics) before it is saved")


class Metrics(dict):
    """The read-only `metrics` of a result document: a mapping over the flat JSON keys (it is a dict for JSON and
    for readers that copy it, but has no item assignment, update, pop...), with typed reads of the core figures.
    Only `ResultDocument` writes into it (`_merge`)."""

    __slots__ = ()
    __setitem__ = __delitem__ = update = setdefault = pop = popitem = clear = __ior__ = _read_only

    def __reduce__(self):  # pickle / deepcopy build it from a plain dict (they would call __setitem__)
        return (Metrics, (dict(self),))

    def __copy__(self) -> Metrics:
        return Metrics(self)

    def __deepcopy__(self, memo: dict) -> Metrics:
        import copy

        return Metrics(copy.deepcopy(dict(self), memo))

    def _merge(self, facts: Mapping[str, Any]) -> None:
        dict.update(self, facts)

    # --------------------------------------------------------------------------- typed reads
    def number(self, key: str) -> float | None:
        """`key` as a finite float, else None (a result is untrusted input)."""
        return finite(self.get(key))

    def interval(self, key: str) -> tuple[float, float] | None:
        """`key + "_ci95"` as (low, high) when it is two finite numbers in order, else None."""
        raw = self.get(f"{key}_ci95")
        if not isinstance(raw, (list, tuple)) or len(raw) != 2:
            return None
        low, high = finite(raw[0]), finite(raw[1])
        return (low, high) if low is not None and high is not None and low <= high else None

    def stat(self, key: str, stat: str = "p50") -> float | None:
        """A statistic of a timing distribution (`stat("tpot_ms")`: its median), else None."""
        block = self.get(key)
        return finite(block.get(stat)) if isinstance(block, dict) else None

    def block(self, key: str) -> dict[str, Any]:
        """A block of the core (`rounds`, `noise`, a distribution) as a dict ({} when absent or not a dict)."""
        value = self.get(key)
        return value if isinstance(value, dict) else {}

    @property
    def rounds(self) -> dict[str, Any]:
        return self.block("rounds")

    @property
    def noise(self) -> dict[str, Any]:
        return self.block("noise")

    @property
    def claim_check(self) -> dict | None:
        value = self.get("claim_check")
        return value if isinstance(value, dict) else None


# ----------------------------------------------------------------------------------------- shared declarations
# keys more than one namespace declares (each technique or engine lists them in its own `metric_keys`)
ENDPOINT_CLIENT_KEYS: dict[str, str] = {
    **dict.fromkeys(("client", "client_peak_rss_bytes", "client_saturated", "client_saturation_reason",
                     "client_lateness_ms", "concurrency", "multi_token_deliveries", "prefix_cache",
                     "nondeterministic_outputs"), "the load client's own figures (endpoint/client.py)"),
    **dict.fromkeys(("failure_rate", "failures", "failures_by_kind", "requests_failed", "requests_ok", "requests_sent",
                     "requests_resent", "warmup_failures"), "requests the server failed or answered"),
    **dict.fromkeys(("token_count_failures", "token_count_mismatches", "token_count_source", "token_count_unverified",
                     "usage_token_mismatches"), "how the served tokens were counted and checked"),
    **dict.fromkeys(("trace_requests", "trace_span_s", "sessions", "turns", "turns_sent", "turns_not_sent"),
                    "the replayed trace or sessions"),
    **dict.fromkeys(("goodput_req_s", "slo_attainment", "good_requests", "slo", "slo_attainment_by_objective"),
                    "goodput under the SLOs the client was given (metrics.saturation.goodput)"),
}
LEAN_LOOP_KEYS: dict[str, str] = dict.fromkeys(
    ("kv_dtype", "lean_cache_buckets", "lean_compile", "lean_decode_steps", "lean_forward_ms", "lean_forward_ms_per_token",
     "lean_loop_overhead_ms", "lean_overhead_ms_per_token", "lean_prefill", "lean_prefill_buckets", "lean_prefill_fallback",
     "lean_step", "lean_step_fallback", "lean_native_fallback", "lean_kernel_swaps", "lean_attention",
     "lean_fused_int4_calls", "native_step"),
    "how the lean decode loop ran (tuners/lean: its step, cache, prefill and fallbacks)")
SLOT_ENGINE_KEYS: dict[str, str] = dict.fromkeys(
    ("batch_engine", "batch_impl", "slot_decode_kernel_rows", "slot_engine_build_s", "slot_engine_reused",
     "slot_kernel_screen", "slot_kernel_swaps", "slot_length_buckets", "slot_mixed_steps", "slot_step_buckets",
     "spec_acceptance", "spec_acceptance_by_position", "spec_accepted", "spec_draft_tokens", "spec_drafted",
     "output_mismatches_vs_generate", "kv_cache_bytes", "kv_cache_tokens"),
    "how the slot engine served the trace (tuners/batch/slots.py)")
# rows that are not a registered technique's: the plain baseline, an endpoint's, a launched engine's (engine_tune)
ROW_KINDS: dict[str, dict[str, str]] = {
    "baseline": {},
    "endpoint": dict(ENDPOINT_CLIENT_KEYS),
    "engine": {},
}
