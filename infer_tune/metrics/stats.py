"""Summary statistics of raw timing samples, and bootstrap intervals used by `compare`."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

PERCENTILES = (50, 90, 99)
CHUNK_ELEMENTS = 1 << 22  # a bootstrap draws resamples x n indices; at most this many at a time (32 MiB)


def bootstrap_stat(data: np.ndarray, reduce, *, rng: np.random.Generator, resamples: int) -> np.ndarray:
    """`reduce(resampled, axis=1)` of `resamples` bootstrap resamples of `data`, drawn in chunks so
    memory stays bounded however many samples there are (a long suite's pooled ITL)."""
    out = np.empty(resamples)
    step = max(1, CHUNK_ELEMENTS // max(data.size, 1))
    for start in range(0, resamples, step):
        count = min(step, resamples - start)
        out[start:start + count] = reduce(data[rng.integers(0, data.size, size=(count, data.size))], axis=1)
    return out


def summarize(samples: Sequence[float], *, seed: int = 0, resamples: int = 1000) -> dict[str, float | int | None]:
    """p50/p90/p99, mean, stdev, MAD and n of `samples`, plus a 95% bootstrap interval of the median.

    An empty sample list gives `None` values with `n == 0` (e.g. TPOT of one-token outputs).
    """
    values = np.asarray([s for s in samples if s is not None], dtype=np.float64)
    if values.size == 0:
        return {"p50": None, "p90": None, "p99": None, "mean": None, "stdev": None, "mad": None,
                "p50_ci95": None, "n": 0}
    p50, p90, p99 = (float(np.percentile(values, q)) for q in PERCENTILES)
    low, high = median_interval(values, seed=seed, resamples=resamples)
    return {
        "p50": p50,
        "p90": p90,
        "p99": p99,
        "mean": float(values.mean()),
        "stdev": float(values.std(ddof=1)) if values.size > 1 else 0.0,
        "mad": float(np.median(np.abs(values - p50))),
        "p50_ci95": [low, high],
        "n": int(values.size),
    }


def reduce_stat(stat: str):
    """`reduce(x, axis)` computing `p50`/`p90`/`p99`/`mean` along an axis."""
    def reduce(x: np.ndarray, axis: int = -1) -> np.ndarray:
        return x.mean(axis=axis) if stat == "mean" else np.percentile(x, float(stat[1:]), axis=axis)

    return reduce


def bootstrap_interval(values: Sequence[float], stat: str = "p50", *, seed: int = 0,
                       resamples: int = 1000) -> tuple[float, float]:
    """95% percentile-bootstrap interval of one statistic of one sample set (the one interval helper)."""
    data = np.asarray(values, dtype=np.float64)
    stats = bootstrap_stat(data, reduce_stat(stat), rng=np.random.default_rng(seed), resamples=resamples)
    return float(np.percentile(stats, 2.5)), float(np.percentile(stats, 97.5))


def median_interval(values: Sequence[float], *, seed: int = 0, resamples: int = 1000) -> tuple[float, float]:
    """95% percentile-bootstrap interval of the median."""
    return bootstrap_interval(values, "p50", seed=seed, resamples=resamples)


def ratio_interval(
    base: Sequence[float], cand: Sequence[float], *, stat: str = "p50", seed: int = 0, resamples: int = 2000
) -> tuple[float, float, float]:
    """Point estimate and 95% bootstrap interval of stat(cand) / stat(base).

    `stat` is `p50`, `p90`, `p99` or `mean`; both sample sets are resampled independently.
    """
    b = np.asarray(base, dtype=np.float64)
    c = np.asarray(cand, dtype=np.float64)
    if b.size == 0 or c.size == 0:
        raise ValueError("ratio_interval needs samples on both sides")
    rng = np.random.default_rng(seed)
    reduce = reduce_stat(stat)
    point = float(reduce(c) / reduce(b))
    rb = bootstrap_stat(b, reduce, rng=rng, resamples=resamples)
    rc = bootstrap_stat(c, reduce, rng=rng, resamples=resamples)
    ratios = rc / rb
    return point, float(np.percentile(ratios, 2.5)), float(np.percentile(ratios, 97.5))


def paired_ratio_interval(
    base: Sequence[float], base_keys: Sequence[int], cand: Sequence[float], cand_keys: Sequence[int],
    *, seed: int = 0, resamples: int = 2000,
) -> tuple[float, float, float] | None:
    """Ratio of medians for paired designs: both runs timed the same prompts (keys = prompt index).

    Per prompt, the ratio median(cand samples) / median(base samples); the point estimate is the
    median of those ratios. The interval is a two-level bootstrap: prompts resampled with replacement,
    and each prompt's own samples resampled on both sides. Pairing removes the prompt-to-prompt spread
    (context length, output content) that dominates an unpaired comparison of few requests.
    Returns None when fewer than two prompts are shared.
    """
    def group(values: Sequence[float], keys: Sequence[int]) -> dict[int, np.ndarray]:
        out: dict[int, list[float]] = {}
        for v, k in zip(values, keys):
            out.setdefault(int(k), []).append(float(v))
        return {k: np.asarray(v) for k, v in out.items()}

    b, c = group(base, base_keys), group(cand, cand_keys)
    shared = sorted(set(b) & set(c))
    if len(shared) < 2:
        return None
    point = float(np.median([np.median(c[k]) / np.median(b[k]) for k in shared]))
    rng = np.random.default_rng(seed)
    stats = np.empty(resamples)
    for r in range(resamples):
        picks = rng.choice(len(shared), size=len(shared))
        ratios = []
        for p in picks:
            bk, ck = b[shared[p]], c[shared[p]]
            ratios.append(np.median(rng.choice(ck, ck.size)) / np.median(rng.choice(bk, bk.size)))
        stats[r] = np.median(ratios)
    return point, float(np.percentile(stats, 2.5)), float(np.percentile(stats, 97.5))


# two-sided 95% quantiles of Student's t by degrees of freedom (1..30); 1.96 beyond
_T95 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145,
        2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048,
        2.045, 2.042)


def t95(df: int) -> float:
    """The 97.5% quantile of Student's t with `df` degrees of freedom (a 95% two-sided interval)."""
    return _T95[df - 1] if 1 <= df <= len(_T95) else 1.96


def log_ratio_interval(ratios: Sequence[float]) -> dict[str, float | list[float] | int] | None:
    """Geometric mean of per-round ratios and its 95% t-interval (on the logs, so 2x and 0.5x are symmetric).

    Each round measured the baseline and the candidate back to back, so a ratio per round cancels the
    host's drift; the rounds are the independent samples. Returns {point, ci95: [low, high],
    half_width_pct, rounds}, or None with fewer than two finite positive ratios.
    """
    logs = np.log(np.asarray([r for r in ratios if r is not None and np.isfinite(r) and r > 0], dtype=np.float64))
    if logs.size < 2:
        return None
    mean, half = float(logs.mean()), t95(logs.size - 1) * float(logs.std(ddof=1)) / np.sqrt(logs.size)
    return {"point": float(np.exp(mean)), "ci95": [float(np.exp(mean - half)), float(np.exp(mean + half))],
            "half_width_pct": 100.0 * float(np.expm1(half)), "rounds": int(logs.size)}


POOL_ALPHA = 0.25  # rounds are pooled with the pairs unless their F test rejects "no round effect" at this level
POOL_MIN_ROUNDS = 4  # below, the F test has too few degrees of freedom to see a round effect: rounds alone


def f_sf(f: float, d1: int, d2: int) -> float:
    """P(F > f) for Snedecor's F with (d1, d2) >= (2, 2) degrees of freedom (numerically integrated: the
    beta density of d1 f / (d1 f + d2) is bounded for these degrees of freedom)."""
    if f <= 0:
        return 1.0
    a, b = d1 / 2.0, d2 / 2.0
    x = d1 * f / (d1 * f + d2)
    grid = np.linspace(0.0, x, 4001)
    log_norm = math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b)
    with np.errstate(divide="ignore", invalid="ignore"):
        density = np.exp(log_norm + (a - 1) * np.log(grid) + (b - 1) * np.log1p(-grid))
    density[~np.isfinite(density)] = 0.0 if a > 1 else math.exp(log_norm)
    return float(max(0.0, 1.0 - np.trapezoid(density, grid)))


def paired_rounds_interval(logs: Sequence[Sequence[float]]) -> dict | None:
    """The interval of a ratio measured as one paired log ratio per (round, prompt): a rounds x prompts table.

    The rounds are the samples (`log_ratio_interval` of the round means: t with rounds - 1 degrees of
    freedom) unless the rounds do not differ beyond what the pairs' own spread explains: a two-way analysis
    of the table (prompts differ by design: a speculative row's ratio depends on the prompt) whose F test of
    the rounds against the residual does not reject "no round effect" at POOL_ALPHA (0.25, the "sometimes
    pool" rule), with at least POOL_MIN_ROUNDS rounds, pools the rounds' and the residual's mean squares,
    and the interval takes t with (rounds - 1) x prompts degrees of freedom (simulated coverage of the
    nominal 95%: 0.93-0.97 whatever the rounds' own spread, docs/metrics.md). The point is the same either way (the mean of every log).
    Returns log_ratio_interval's keys plus `pooled`, `df`, `rounds_f_p` (the F test's p, None when not
    taken), or None with fewer than two rounds.
    """
    table = np.asarray(logs, dtype=np.float64)
    if table.ndim != 2 or table.shape[0] < 2 or not np.all(np.isfinite(table)):
        return None
    rounds, prompts = table.shape
    by_round = log_ratio_interval([float(np.exp(m)) for m in table.mean(axis=1)])
    if by_round is None:
        return None
    by_round.update(pooled=False, df=rounds - 1, rounds_f_p=None)
    if rounds < POOL_MIN_ROUNDS or prompts < 2:
        return by_round
    grand = table.mean()
    ss_rounds = prompts * float(((table.mean(axis=1) - grand) ** 2).sum())
    residual = table - table.mean(axis=1, keepdims=True) - table.mean(axis=0, keepdims=True) + grand
    ss_residual = float((residual ** 2).sum())
    df_rounds, df_residual = rounds - 1, (rounds - 1) * (prompts - 1)
    if ss_residual <= 0:
        return by_round
    p = f_sf((ss_rounds / df_rounds) / (ss_residual / df_residual), df_rounds, df_residual)
    by_round["rounds_f_p"] = p
    if p <= POOL_ALPHA:
        return by_round
    df = df_rounds + df_residual
    half = t95(df) * math.sqrt((ss_rounds + ss_residual) / df / (rounds * prompts))
    return {"point": float(np.exp(grand)), "ci95": [float(np.exp(grand - half)), float(np.exp(grand + half))],
            "half_width_pct": 100.0 * float(np.expm1(half)), "rounds": rounds, "pooled": True, "df": df,
            "rounds_f_p": p}


def pair_interval(cand: list[float | None], ref: list[float | None]) -> dict | None:
    """The 95% interval of cand / ref from two variants' `per_round` lists of the same interleaved rounds
    (infer_tune.rounds: each round's pair ran within that round), or None when fewer than two rounds
    pair up."""
    ratios = [c / r for c, r in zip(cand, ref) if c and r]
    return log_ratio_interval(ratios) if len(ratios) >= 2 else None
