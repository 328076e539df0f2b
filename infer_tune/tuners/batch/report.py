"""What the combined report leads a batching row with (docs/batch.md): output throughput, mean e2e and
goodput of a continuous batcher against the static batcher that replayed the same trace (same rate,
batch size, burstiness, requests and seed, in the same stage); a static row shows its own figures as the
reference; a closed-loop sweep row its throughput against the single-stream baseline. When the pair was
measured in the same interleaved rounds, each figure carries the 95% interval of its per-round ratios."""

from __future__ import annotations

from infer_tune.report.leads import Figure, Lead, change_pct, interval, number, ratio, same_stage
from infer_tune.tuners.batch.analysis import paired

SAME_TRACE = ("rate", "batch_size", "burstiness", "requests", "seed")
VS_STATIC = "static batching at the same rate"


def _static_twin(doc: dict, docs: list[dict]) -> dict | None:
    config = doc.get("config") or {}
    for other in docs:
        c = other.get("config") or {}
        if (other.get("technique") == "batch" and c.get("scheduler") == "static" and same_stage(doc, other)
                and all(c.get(k) == config.get(k) for k in SAME_TRACE)):
            return other
    return None


def _mean_e2e(m: dict) -> float | None:
    return number((m.get("e2e_ms") or {}).get("mean")) if isinstance(m.get("e2e_ms"), dict) else None


def report_columns(doc: dict, docs: list[dict]) -> Lead:
    m = doc.get("metrics") or {}
    config = doc.get("config") or {}
    scheduler = config.get("scheduler")
    if scheduler == "sweep":
        return Lead((Figure("throughput", number(m.get("throughput_ratio_vs_baseline")), "x",
                            interval(m, "throughput_ratio_vs_baseline")),
                     Figure("output", number(m.get("output_throughput_tok_s")), "tok/s")),
                    "single-stream baseline (closed loop)")
    twin = _static_twin(doc, docs) if scheduler == "continuous" else None
    if twin is None:
        figures = [Figure("throughput", number(m.get("output_throughput_tok_s")), "tok/s"),
                   Figure("mean e2e", _mean_e2e(m), "ms")]
        if number(m.get("goodput_req_s")) is not None:
            figures.append(Figure("goodput", number(m.get("goodput_req_s")), "req/s"))
        vs = ("itself: the reference for continuous batching" if scheduler == "static"
              else "no static run of this trace here")
        return Lead(tuple(figures), vs)
    t = twin.get("metrics") or {}
    # measured in the same rounds: the rounds' geometric mean and its interval; else the totals' ratio
    through, e2e = paired(m, t, "output_throughput_tok_s"), paired(m, t, "e2e_ms_mean")
    figures = [Figure("throughput", through["point"], "x", tuple(through["ci95"])) if through else
               Figure("throughput", ratio(m.get("output_throughput_tok_s"), t.get("output_throughput_tok_s")), "x"),
               Figure("mean e2e", 100.0 * (e2e["point"] - 1), "%", tuple(100.0 * (v - 1) for v in e2e["ci95"]))
               if e2e else Figure("mean e2e", change_pct(_mean_e2e(m), _mean_e2e(t)), "%")]
    goodput = ratio(m.get("goodput_req_s"), t.get("goodput_req_s"))
    if goodput is not None:
        figures.append(Figure("goodput", goodput, "x"))
    return Lead(tuple(figures), f"{VS_STATIC} ({float(config.get('rate') or 0):g} req/s)")
