"""What a batching sweep or serving simulation concludes: the throughput knee, memory predictions for
`memory_limit`, the highest rate that meets the SLOs, and the continuous-batching claim check (judged
from the 95% intervals of the per-round ratios when static and continuous ran in the same rounds:
docs/architecture.md, "Decisions taken from intervals")."""

from __future__ import annotations

import math

from infer_tune.document import as_document
from infer_tune.metrics import kv
from infer_tune.metrics.stats import pair_interval

KNEE_GAIN = 0.05  # one more doubling of the batch buying less than 5% throughput
CLAIM = "continuous batching cuts mean latency by 40%+ and raises throughput 1.5x over static batching on mixed load"
CLAIM_LATENCY_RATIO = 0.60  # continuous mean e2e / static mean e2e at most this
CLAIM_THROUGHPUT_RATIO = 1.5  # continuous output tok/s / static output tok/s at least this
LOADED = 0.9  # the static server computing at least 90% of the time from the trace start to its last token
HELD, NOT_HELD, INCONCLUSIVE = "held", "did not hold here", "inconclusive"  # the claims table's words
POINT_ONLY = "point estimate (no paired rounds)"


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


def paired(m: dict, t: dict, figure: str) -> dict | None:
    """`figure` of one row over another's, round by round (log_ratio_interval's dict: point, ci95,
    rounds), when both rows were measured in the same interleaved rounds (same count, same elapsed
    time), else None. `m`, `t`: the rows' metrics."""
    mine, theirs = m.get("rounds") or {}, t.get("rounds") or {}
    a, b = (mine.get("per_round") or {}).get(figure), (theirs.get("per_round") or {}).get(figure)
    if not a or not b or len(a) != len(b) or mine.get("elapsed_s") != theirs.get("elapsed_s"):
        return None
    return pair_interval(a, b)


def part_verdict(point: float, ci: list[float] | None, threshold: float, *, at_most: bool) -> str:
    """One part of the claim: held when the whole interval is on the claim's side of `threshold`, did not
    hold when the whole interval is on the other side, inconclusive when it straddles; without an
    interval, the point decides (and the claim says it was a point estimate)."""
    low, high = ci if ci is not None else (point, point)
    if at_most:
        return HELD if high <= threshold else NOT_HELD if low > threshold else INCONCLUSIVE
    return HELD if low >= threshold else NOT_HELD if high < threshold else INCONCLUSIVE


def combined(parts: list[str]) -> str:
    """The claim: held when every part held, did not hold when any part did not, else inconclusive."""
    return HELD if all(p == HELD for p in parts) else NOT_HELD if NOT_HELD in parts else INCONCLUSIVE


def claim_check(static: dict, continuous: dict, rate: float, loaded: bool) -> dict:
    """The claim judged on two metrics dicts measured on the same trace at `rate`.

    When the two rows ran in the same interleaved rounds (`metrics.rounds.per_round`), each ratio is
    the rounds' geometric mean with its 95% interval (`pair_interval`) and each part is judged from
    that interval (`part_verdict`); otherwise from the ratio of the rows' totals, marked POINT_ONLY.
    `held` (a bool) is true only for the verdict "held"; `verdict` is the three-way answer.
    """
    e2e, through = paired(continuous, static, "e2e_ms_mean"), paired(continuous, static, "output_throughput_tok_s")
    if e2e and through:
        latency, latency_ci = e2e["point"], e2e["ci95"]
        throughput, throughput_ci = through["point"], through["ci95"]
        judged_from, rounds = f"{min(e2e['rounds'], through['rounds'])} paired rounds", e2e["rounds"]
    else:
        latency = continuous["e2e_ms"]["mean"] / static["e2e_ms"]["mean"]
        throughput = continuous["output_throughput_tok_s"] / static["output_throughput_tok_s"]
        latency_ci = throughput_ci = None
        judged_from, rounds = POINT_ONLY, None
    latency_verdict = part_verdict(latency, latency_ci, CLAIM_LATENCY_RATIO, at_most=True)
    throughput_verdict = part_verdict(throughput, throughput_ci, CLAIM_THROUGHPUT_RATIO, at_most=False)
    verdict = combined([latency_verdict, throughput_verdict])
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
        "mean_e2e_ratio_ci95": latency_ci,
        "mean_latency_change_pct": 100 * (latency - 1),
        "throughput_ratio": throughput,
        "throughput_ratio_ci95": throughput_ci,
        "judged_from": judged_from,
        "rounds": rounds,
        "latency_verdict": latency_verdict,
        "throughput_verdict": throughput_verdict,
        "latency_held": latency_verdict == HELD,
        "throughput_held": throughput_verdict == HELD,
        "held": verdict == HELD,
        "verdict": verdict,
    }
    if verdict == INCONCLUSIVE:
        out["why"] = "a ratio's 95% interval straddles its threshold: more rounds would decide"
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
            by[config["scheduler"]][config["rate"]] = as_document(doc).metrics  # a hand-made row too
    return claims_by_rate(by["static"], by["continuous"])[0]


def claim_line(claim: dict) -> str:
    """One human line for a claim check: what was measured, then the verdict."""
    return f"{claim['finding']} -> {verdict_of(claim)}"


def verdict_of(claim: dict) -> str:
    """The three-way verdict; a claim saved before it had one: from `held`."""
    return claim.get("verdict") or (HELD if claim["held"] else NOT_HELD)


def _part(claim: dict, name: str) -> str:
    verdict = claim.get(f"{name}_verdict") or (HELD if claim[f"{name}_held"] else NOT_HELD)
    return {HELD: "ok", NOT_HELD: "no"}.get(verdict, verdict)


def finding(claim: dict) -> str:
    """What was measured, in one line (the claims table shows the verdict beside it): each ratio with
    its 95% interval when paired rounds gave one, and what it was judged from."""
    busy = claim.get("static_busy_share")
    load = (f"static batcher busy {busy:.0%} of the time" if busy is not None else "static batcher busy: -")
    load += "" if claim["static_loaded"] else ", not loaded"
    e2e_ci, through_ci = claim.get("mean_e2e_ratio_ci95"), claim.get("throughput_ratio_ci95")
    e2e = f"{claim['mean_latency_change_pct']:+.0f}%"
    if e2e_ci:
        e2e += f" [{100 * (e2e_ci[0] - 1):+.0f}%, {100 * (e2e_ci[1] - 1):+.0f}%]"
    through = f"{claim['throughput_ratio']:.2f}x"
    if through_ci:
        through += f" [{through_ci[0]:.2f}, {through_ci[1]:.2f}]"
    line = (f"at {claim['rate']:g} req/s ({load}): mean e2e {e2e} (claim <= -40%: {_part(claim, 'latency')}), "
            f"output throughput {through} (claim >= 1.5x: {_part(claim, 'throughput')})")
    return line + (f"; {claim['judged_from']}" if claim.get("judged_from") else "")
