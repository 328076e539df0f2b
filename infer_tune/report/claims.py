"""The claims table: every claim check found in a set of results, in one shape.

A claim row: the claim as usually stated, what was measured (a human sentence with the numbers), the
number and its interval when there is one, and the verdict: `held`, `did not hold here`, or `not
applicable` with the reason. Techniques keep their claim checks in their results (`metrics.claim_check`,
`metrics.claims` or the document's `claims`); this module only reads and normalises them.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

HELD, NOT_HELD, NOT_APPLICABLE = "held", "did not hold here", "not applicable"


@dataclass
class ClaimRow:
    claim: str
    measured: str
    verdict: str
    value: float | None = None
    interval: list[float] | None = None
    why: str = ""
    technique: str = ""
    run_id: str = ""

    def to_dict(self) -> dict:
        return asdict(self)


def _verdict(held) -> str:
    return NOT_APPLICABLE if held is None else HELD if held else NOT_HELD


def _quantize(c: dict, doc: dict) -> ClaimRow:
    def f(v, spec):
        return "-" if v is None else format(v, spec)

    measured = (f"{c['method']}: {f(c.get('bytes_ratio_vs_16bit'), '.0%')} of the 16-bit bytes; "
                f"{f(c.get('speedup_judged'), '.2f')}x decode vs "
                f"{'bf16' if c.get('speedup_vs_16bit') is not None else 'the baseline'}; "
                f"perplexity {f(c.get('ppl_delta_pct'), '+.2f')}%, BLEU drift {f(c.get('bleu_drift'), '+.2f')}")
    missed = [part for part, key in (("size", "size_held"), ("speed", "speed_held"), ("quality", "quality_held"))
              if c.get(key) is False]
    return ClaimRow(claim=c["claim"], measured=measured, verdict=_verdict(c.get("held")),
                    value=c.get("speedup_judged"), why=f"{', '.join(missed)} missed" if missed else "")


def _kv(c: dict, doc: dict) -> ClaimRow | None:
    if c.get("claim") == "compute_saved_at_500_tokens":
        measured = (f"{c['new_tokens']} tokens after a {c['prompt_tokens']}-token prompt: "
                    f"{c['flops_saved_fraction']:.1%} fewer FLOPs with the cache")
        if "wall_saved_fraction" in c:
            measured += (f"; measured at {c['measured_new_tokens']} tokens: {c['wall_saved_fraction']:.1%} "
                         "less wall time")
        return ClaimRow(claim="KV cache: a 500-token answer needs over 80% less compute",
                        measured=measured, verdict=_verdict(c.get("held")), value=c["flops_saved_fraction"])
    if c.get("claim") == "kv_bytes_at_long_context":
        return ClaimRow(claim="KV cache costs memory: several GB at 128K context",
                        measured=f"{c['kv_bytes_16bit'] / 1e9:.2f} GB in 16-bit at {c['context_tokens']} tokens",
                        verdict=_verdict(c.get("held")), value=c["kv_bytes_16bit"])
    return None


def _generic(c: dict, doc: dict) -> ClaimRow | None:
    """A claim check in the common shape: claim/statement, measured, held (True/False/None), why..."""
    statement = c.get("statement") or c.get("claim")
    if not statement:
        return None
    measured = c.get("finding") or c.get("measured")  # `finding`: the technique's own human line
    return ClaimRow(claim=str(statement), measured=measured if isinstance(measured, str) else "",
                    verdict=c.get("verdict") or _verdict(c.get("held")), value=c.get("value"),
                    interval=c.get("interval"), why=str(c.get("why", "")))


def _candidates(doc: dict) -> list[dict]:
    metrics = doc.get("metrics") or {}
    found = []
    for source in (metrics.get("claim_check"), metrics.get("claims"), doc.get("claims")):
        if isinstance(source, dict):
            found.append(source)
        elif isinstance(source, list):
            found.extend(c for c in source if isinstance(c, dict))
    return found


def collect(docs: list[dict]) -> list[ClaimRow]:
    """Every claim check of `docs`, deduplicated (a sweep repeats its claims on each of its rows)."""
    rows: list[ClaimRow] = []
    seen: set[tuple[str, str]] = set()
    for doc in docs:
        for c in _candidates(doc):
            if "speedup_judged" in c and "method" in c:
                row = _quantize(c, doc)
            elif c.get("claim") in ("compute_saved_at_500_tokens", "kv_bytes_at_long_context"):
                row = _kv(c, doc)
            else:
                row = _generic(c, doc)
            if row is None or (row.claim, row.measured) in seen:
                continue
            seen.add((row.claim, row.measured))
            row.technique, row.run_id = str(doc.get("technique", "")), str(doc.get("run_id", ""))
            rows.append(row)
    return rows
