"""Bandwidth-bound ceiling of decoding: every decode step reads the weights (and the KV cache) once.

A fraction of the ceiling above 1 is a decode faster than the read it is divided by: the ceiling was not
this decode's (a read of other bytes, of another memory level, in other minutes), a measurement error and
never a result. It is refused: `roofline_fraction` None, `roofline_refused` says by how much and why.
"""

from __future__ import annotations

MAX_FRACTION = 1.0


def refusal(fraction: float | None, ceiling_from: str = "the ceiling") -> str | None:
    """Why a fraction of the ceiling is not a result (above MAX_FRACTION), or None where it is one."""
    if fraction is None or fraction <= MAX_FRACTION:
        return None
    return (f"decode at {fraction:.2f}x {ceiling_from}: faster than the read it is bounded by, so that read "
            "was not this decode's ceiling (a measurement error, not a result)")


def ceiling_tok_s(bandwidth_gb_s: float, bytes_per_step: float, batch_size: float = 1) -> float | None:
    """Tokens/s if a decode step took exactly the time to stream `bytes_per_step` through memory (`batch_size`:
    tokens a step gives, rows x tokens per row)."""
    if not bandwidth_gb_s or not bytes_per_step:
        return None
    return batch_size * bandwidth_gb_s * 1e9 / bytes_per_step


def roofline(
    bandwidth_gb_s: float, weight_bytes: int, kv_bytes_read: float, batch_size: int, tpot_ms_p50: float | None,
    tokens_per_pass: float = 1.0,
) -> dict[str, float | None]:
    """`roofline_tok_s` (ceiling) and `roofline_fraction` (achieved decode tokens/s / ceiling); a fraction
    above 1 is refused (`roofline_refused`, the fraction None). `tokens_per_pass`: tokens a sequence gets from
    one read of the weights (speculative decoding: the verified drafts plus the bonus token of a verify pass)."""
    ceiling = ceiling_tok_s(bandwidth_gb_s, weight_bytes + kv_bytes_read, batch_size * tokens_per_pass)
    if ceiling is None or not tpot_ms_p50:
        return {"roofline_tok_s": ceiling, "roofline_fraction": None, "decode_tok_s": None, "roofline_refused": None}
    achieved = batch_size * 1000.0 / tpot_ms_p50
    why = refusal(achieved / ceiling)
    return {"roofline_tok_s": ceiling, "roofline_fraction": None if why else achieved / ceiling,
            "decode_tok_s": achieved, "roofline_refused": why}


def by_round(reads_gb_s: list[float | None], tpot_ms: list[float | None], bytes_per_step: float,
             batch_size: int = 1, tokens_per_pass: float = 1.0) -> dict | None:
    """The fraction of the ceiling per round, each round's decode (its median TPOT) over the ceiling of the
    read taken right after it, and their geometric mean with its 95% interval (`stats.log_ratio_interval`):
    where the memory's speed moves between rounds, a pooled decode over one median read mixes rounds of
    either state. A mean above 1 is refused as `roofline` refuses one. None without two rounds that have both."""
    from infer_tune.metrics.stats import log_ratio_interval

    fractions = []
    for read, tpot in zip(reads_gb_s, tpot_ms):
        ceiling = ceiling_tok_s(read, bytes_per_step, batch_size * tokens_per_pass) if read else None
        fractions.append(batch_size * 1000.0 / tpot / ceiling if ceiling and tpot else None)
    interval = log_ratio_interval(fractions)
    if interval is None:
        return None
    why = refusal(interval["point"], "the rounds' reads (geometric mean)")
    return {"roofline_fraction": None if why else interval["point"],
            "roofline_fraction_ci95": None if why else interval["ci95"],
            "roofline_fraction_by_round": fractions, "roofline_refused": why}
