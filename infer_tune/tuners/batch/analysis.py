"""What a batching sweep or serving simulation concludes: the throughput knee, memory predictions for
`memory_limit`, the highest rate that meets the SLOs, and the continuous-batching claim check."""

from __future__ import annotations

import math

from infer_tune.metrics import kv

KNEE_GAIN = 0.05  # one more doubling of the batch buying less than 5% throughput
CLAIM = "continuous batching cuts mean latency by 40%+ and raises throughput 1.5x over static batching on mixed load"
CLAIM_LATENCY_RATIO = 0.60  # continuous mean e2e / static mean e2e at most this
CLAIM_THROUGHPUT_RATIO = 1.5  # continuous output tok/s / static output tok/s at least this
LOADED = 0.9  # the static server computing at least 90% of the time from the trace start to its last token


def gain_per_doubling(b0: int, t0: float, b1: int, t1: float) -> float:
    """Throughput gain per doubling of the batch between two measured batch sizes (geometric)."""
    doublings = math.log2(b1 / b0)
    return (t1 / t0) ** (1 / doublings) - 1 if doublings > 0 and t0 > 0 else float("nan")


def knee(throughput: dict[int, float]) -> tuple[int | None, dict[int, float]]:
    """(knee batch size, gain per doubling to the next measured size keyed by the smaller size).

    The knee is the smallest batch size from which one more doubling gains < 5% output throughput;
    None when every measured step still gains that much (the knee is beyond the sweep).
    """
    sizes = sorted(throughput)
    gains = {a: gain_per_doubling(a, throughput[a], b, throughput[b]) for a, b in zip(sizes, sizes[1:])}
    at = next((a for a in sizes[:-1] if gains[a] < KNEE_GAIN), None)
    return at, gains


def analytic_batch_bytes(shape: kv.ModelShape, batch_size: int, prompt_tokens: int, new_tokens: int,
                         bytes_per_value: int) -> int:
    """Memory a padded batch adds beyond the weights: its KV cache at the final length, the prefill's
    largest transient activations (MLP intermediate and QKV of every position), and last-token logits."""
    cache = kv.kv_bytes(shape, prompt_tokens + new_tokens, bytes_per_value * 8, batch_size)
    prefill = batch_size * prompt_tokens * (3 * shape.intermediate + 4 * shape.hidden) * bytes_per_value
    logits = batch_size * shape.vocab * 4 * 2
    return int(cache + prefill + logits)


def predicted_delta(batch_size: int, work: int, measured: dict[int, tuple[int, int]], analytic: int) -> int:
    """Predicted memory growth of a batch: the analytic size, or the largest measured delta per unit of
    work (batch x padded length) scaled to this batch, whichever is larger. `measured`: size -> (delta, work)."""
    scaled = [delta * work / w for delta, w in measured.values() if w > 0]
    return int(max([analytic, *scaled]))


def max_rate_meeting_slo(rows: list[dict], target: float) -> float | None:
    """Highest rate whose SLO attainment is at least `target` (rows: {rate, slo_attainment})."""
    ok = [r["rate"] for r in rows if r.get("slo_attainment") is not None and r["slo_attainment"] >= target]
    return max(ok) if ok else None


def loaded_rate(static_rows: list[dict]) -> tuple[float | None, bool]:
    """The rate where the machine is loaded: the highest swept rate at which the static batcher was busy (a
    batch running) at least 90% of the time, where both batchers run at capacity and throughputs compare;
    else the highest rate (second value: whether the static batcher was loaded there)."""
    rows = sorted(static_rows, key=lambda r: r["rate"])
    loaded = [r["rate"] for r in rows if (r.get("busy_share") or 0.0) >= LOADED]
    if loaded:
        return loaded[-1], True
    return (rows[-1]["rate"], False) if rows else (None, False)


def claim_check(static: dict, continuous: dict, rate: float, loaded: bool) -> dict:
    """The claim judged on two metrics dicts measured on the same trace at `rate`."""
    latency = continuous["e2e_ms"]["mean"] / static["e2e_ms"]["mean"]
    throughput = continuous["output_throughput_tok_s"] / static["output_throughput_tok_s"]
    latency_held = latency <= CLAIM_LATENCY_RATIO
    throughput_held = throughput >= CLAIM_THROUGHPUT_RATIO
    out = {
        "claim": CLAIM,
        "rate": rate,
        "static_loaded": loaded,
        "static_busy_share": static.get("busy_share"),
        "thresholds": {"mean_e2e_ratio_at_most": CLAIM_LATENCY_RATIO,
                       "throughput_ratio_at_least": CLAIM_THROUGHPUT_RATIO},
        "mean_e2e_ms": {"static": static["e2e_ms"]["mean"], "continuous": continuous["e2e_ms"]["mean"]},
        "output_throughput_tok_s": {"static": static["output_throughput_tok_s"],
                                    "continuous": continuous["output_throughput_tok_s"]},
        "mean_e2e_ratio": latency,
        "mean_latency_change_pct": 100 * (latency - 1),
        "throughput_ratio": throughput,
        "latency_held": latency_held,
        "throughput_held": throughput_held,
        "held": latency_held and throughput_held,
    }
    out["finding"] = finding(out)
    return out


def claims_by_rate(static: dict[float, dict], continuous: dict[float, dict]) -> tuple[dict | None, list[dict]]:
    """The claim at every rate measured with both schedulers (rate -> metrics each), and the one that
    counts: at the highest rate where the static batcher was loaded (`loaded_rate`)."""
    by_rate = [claim_check(static[rate], continuous[rate], rate, (static[rate].get("busy_share") or 0) >= LOADED)
               for rate in sorted(set(static) & set(continuous))]
    rate, _ = loaded_rate([{"rate": r, "busy_share": m.get("busy_share")} for r, m in static.items()])
    claim = next((c for c in by_rate if c["rate"] == rate), None)
    return claim, by_rate


def summarize(docs: list[dict]) -> dict | None:
    """The claim over a sweep's batch results: static and continuous runs of the same trace, paired by rate."""
    by: dict[str, dict[float, dict]] = {"static": {}, "continuous": {}}
    for doc in docs:
        config = doc.get("config") or {}
        if config.get("scheduler") in by and config.get("rate") is not None:
            by[config["scheduler"]][config["rate"]] = doc["metrics"]
    return claims_by_rate(by["static"], by["continuous"])[0]


def claim_line(claim: dict) -> str:
    """One human line for a claim check: what was measured, then the verdict."""
    return f"{claim['finding']} -> {'held' if claim['held'] else 'did not hold here'}"


def finding(claim: dict) -> str:
    """What was measured, in one line (the claims table shows the verdict beside it)."""
    busy = claim.get("static_busy_share")
    load = (f"static batcher busy {busy:.0%} of the time" if busy is not None else "static batcher busy: -")
    load += "" if claim["static_loaded"] else ", not loaded"
    return (f"at {claim['rate']:g} req/s ({load}): mean e2e {claim['mean_latency_change_pct']:+.0f}% "
            f"(claim <= -40%: {'ok' if claim['latency_held'] else 'no'}), output throughput "
            f"{claim['throughput_ratio']:.2f}x (claim >= 1.5x: {'ok' if claim['throughput_held'] else 'no'})")
