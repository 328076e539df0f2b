"""Bandwidth-bound ceiling of decoding: every decode step reads the weights (and the KV cache) once."""

from __future__ import annotations


def ceiling_tok_s(bandwidth_gb_s: float, bytes_per_step: float, batch_size: int = 1) -> float | None:
    """Tokens/s if a decode step took exactly the time to stream `bytes_per_step` through memory."""
    if not bandwidth_gb_s or not bytes_per_step:
        return None
    return batch_size * bandwidth_gb_s * 1e9 / bytes_per_step


def roofline(
    bandwidth_gb_s: float, weight_bytes: int, kv_bytes_read: float, batch_size: int, tpot_ms_p50: float | None
) -> dict[str, float | None]:
    """`roofline_tok_s` (ceiling) and `roofline_fraction` (achieved decode tokens/s / ceiling)."""
    ceiling = ceiling_tok_s(bandwidth_gb_s, weight_bytes + kv_bytes_read, batch_size)
    if ceiling is None or not tpot_ms_p50:
        return {"roofline_tok_s": ceiling, "roofline_fraction": None, "decode_tok_s": None}
    achieved = batch_size * 1000.0 / tpot_ms_p50
    return {"roofline_tok_s": ceiling, "roofline_fraction": achieved / ceiling, "decode_tok_s": achieved}


def by_round(reads_gb_s: list[float | None], tpot_ms: list[float | None], bytes_per_step: float,
             batch_size: int = 1) -> dict | None:
    """The fraction of the ceiling per round, each round's decode (its median TPOT) over the ceiling of the
    read taken right after it, and their geometric mean with its 95% interval (`stats.log_ratio_interval`):
    where the memory's speed moves between rounds, a pooled decode over one median read mixes rounds of
    either state. None without two rounds that have both."""
    from infer_tune.metrics.stats import log_ratio_interval

    fractions = []
    for read, tpot in zip(reads_gb_s, tpot_ms):
        ceiling = ceiling_tok_s(read, bytes_per_step, batch_size) if read else None
        fractions.append(batch_size * 1000.0 / tpot / ceiling if ceiling and tpot else None)
    interval = log_ratio_interval(fractions)
    if interval is None:
        return None
    return {"roofline_fraction": interval["point"], "roofline_fraction_ci95": interval["ci95"],
            "roofline_fraction_by_round": fractions}
