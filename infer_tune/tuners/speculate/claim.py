"""The speculative-decoding claim check, judged on result documents (no model needed).

"A small draft model (about 1/10 of the target) proposes 8-10 tokens, the target verifies them in
one pass: 2-4x faster on code, TTFT unchanged." Judged per code suite on the fastest lossless config
of any draft source, and apart on the fastest whose draft is a model (see docs/speculate.md).
"""

from __future__ import annotations

from infer_tune.document import ResultDocument, as_document

CLAIM = ("a small draft model (about 1/10 of the target) proposes 8-10 tokens and the target verifies them in "
         "one pass: 2-4x faster on code and structured text, TTFT unchanged")
CLAIM_SPEEDUP = 2.0
CLAIM_TTFT_RATIO = 1.10  # "TTFT unchanged": at most 10% longer than the target alone
CODE_SUITES = ("code", "code-edit")


def lossless(doc: dict) -> bool:
    return as_document(doc).metrics.get("output_mismatches") == 0


def _judge(doc: ResultDocument) -> dict:
    m = doc.metrics
    ttft = m.get("ttft_speedup_vs_baseline")
    ttft_ratio = 1 / ttft if ttft else None
    verdict = {"best": doc["label"], "speedup": m["speedup_vs_baseline"], "ttft_ratio_vs_baseline": ttft_ratio,
               "num_draft_tokens": doc["config"]["num_draft_tokens"],
               "draft_target_param_ratio": m.get("draft_target_param_ratio"),
               "speed_held": m["speedup_vs_baseline"] >= CLAIM_SPEEDUP,
               "ttft_held": ttft_ratio is not None and ttft_ratio <= CLAIM_TTFT_RATIO}
    verdict["held"] = verdict["speed_held"] and verdict["ttft_held"]
    return verdict


def claim_check(by_suite: dict[str, list[dict]]) -> dict | None:
    """The claim judged on each code suite of `by_suite` (suite -> its speculate results).

    None when no code suite was measured or nothing in it was lossless. Per suite: `any_source` is
    the fastest lossless config of any draft source (prompt lookup included); `draft_model` the
    fastest whose draft is a model (a draft model, self-draft or early exit), when there is one.
    """
    judged = {}
    for suite, docs in by_suite.items():
        if suite not in CODE_SUITES:
            continue
        docs = [as_document(d) for d in docs]  # rows made by hand (a test's) are typed here
        ranked = sorted((d for d in docs if lossless(d) and d.speedup), key=lambda d: d.speedup, reverse=True)
        if not ranked:
            continue
        models = [d for d in ranked if d.metrics.get("draft_kind") != "prompt-lookup"]
        judged[suite] = {"any_source": _judge(ranked[0]), "draft_model": _judge(models[0]) if models else None}
    if not judged:
        return None
    claim = {"claim": CLAIM, "thresholds": {"speedup_at_least": CLAIM_SPEEDUP, "ttft_ratio_at_most": CLAIM_TTFT_RATIO},
             "suites": judged, "held": any(v["any_source"]["held"] for v in judged.values()),
             "held_with_draft_model": any(v["draft_model"] is not None and v["draft_model"]["held"]
                                          for v in judged.values())}
    claim["finding"] = finding(claim)
    return claim


def _num(value, spec: str = ".2f") -> str:
    return "-" if value is None else format(value, spec)


def finding(claim: dict) -> str:
    """Per code suite, the fastest lossless config of any source and of a draft model (the verdict apart)."""
    def one(v: dict | None) -> str:
        if v is None:
            return "no draft model in the run"
        ratio = v["draft_target_param_ratio"]
        return (f"{v['best']} {_num(v['speedup'])}x ({'ok' if v['speed_held'] else 'no'}), TTFT "
                f"x{_num(v['ttft_ratio_vs_baseline'])} ({'ok' if v['ttft_held'] else 'no'})"
                + (f", draft/target params {_num(ratio)}" if ratio else ""))

    return "; ".join(f"{suite}: best of any source {one(v['any_source'])}; best draft model {one(v['draft_model'])}"
                     for suite, v in claim["suites"].items())


def render_claim(claim: dict) -> str:
    """One human line: the verdict (of any source, and with a draft model), then what was measured."""
    return (f"\"2-4x on code, TTFT unchanged\" -> {'held' if claim['held'] else 'did not hold here'} "
            f"(with a draft model: {'held' if claim['held_with_draft_model'] else 'did not hold here'}); "
            + claim["finding"])


def summarize(docs: list[dict]) -> dict | None:
    """The claim over a sweep's speculate results, grouped by the suite each was measured on."""
    by_suite: dict[str, list[dict]] = {}
    for doc in docs:
        by_suite.setdefault(str((doc.get("workload") or {}).get("suite", "")), []).append(doc)
    return claim_check(by_suite)
