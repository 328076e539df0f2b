"""Everything the sweep engine writes into a runs directory, and only there: a result saved atomically
(`save_result`), rows measured elsewhere saved under the runs lock (`save_rows`), the sweep-level
hooks' conclusions stored in the results the sweep saved (`conclude_sweep`, `store_claim`), never in
one an earlier run wrote; and the lookup of a finished result by fingerprint (`find_result`)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from infer_tune import results
from infer_tune.document import ResultDocument
from infer_tune.sweep.plan import SweepPlan
from infer_tune.tuners.base import TECHNIQUES, Conclusion, load_techniques, technique_for


def find_result(out_dir: Path, fingerprint: str, technique: str | None = None) -> ResultDocument | None:
    """The newest finished result with this fingerprint in `out_dir` (baseline reuse and --resume)."""
    if not Path(out_dir).exists():
        return None
    for doc in reversed(results.find_results(out_dir)):
        if doc.get("fingerprint") == fingerprint and (technique is None or doc.get("technique") == technique):
            return doc
    return None


def save_result(out_dir: Path, doc: ResultDocument | dict, outputs: list[dict],
                files: dict[str, bytes] | None = None) -> ResultDocument:
    """One result saved atomically as a new folder of `out_dir` (never over an existing run), with `files`
    beside it; the caller holds the runs directory's lock. Returns the saved document, with its `location`."""
    return results.save_run(out_dir, doc, outputs, extra_files=files or None).result


@dataclass
class Row:
    """A result document built outside `run_configs`, its outputs rows and the files saved beside it."""

    doc: ResultDocument | dict  # a dict is typed (ResultDocument.from_dict) when it is saved
    outputs: list[dict] = field(default_factory=list)
    files: dict[str, bytes] = field(default_factory=dict)


def save_rows(out_dir: Path, rows: list[Row], *, resume: bool = False) -> list[ResultDocument]:
    """The engine's writer for rows that `run_configs` cannot measure: a live endpoint's (no weights here, no
    plain baseline: docs/endpoint.md) and expert-placement plans (predictions, nothing measured). Under the
    runs directory's lock, each row is saved atomically; with `resume`, a row whose fingerprint is already
    saved is read back instead. Returns the saved documents (typed, with their `location`), in order
    (docs/architecture.md, "The sweep engine")."""
    out = []
    with results.runs_lock(out_dir):
        for row in rows:
            done = find_result(out_dir, row.doc["fingerprint"], row.doc.get("technique")) if resume else None
            if done is None:
                done = save_result(out_dir, row.doc, row.outputs, row.files)
            out.append(done)
    return out


def conclude_sweep(docs: list[ResultDocument], plan: SweepPlan | None = None, *,
                   own: set[str] | frozenset[str]) -> None:
    """Each technique's `conclude` over its results of the sweep and the configs it skipped, then the plan's
    own `conclude` over every result (which may also set keys in place), each `Conclusion` stored in the
    rows it is about; stored on disk only in the results this sweep saved (`own`: their run ids), whose
    changed `result.json` is rewritten atomically and whose folders get the files. A result read back
    from an earlier run (`resume`, a reused baseline, a landed folder that was there) is never rewritten:
    its `result.json` stays byte for byte what that run wrote."""
    load_techniques()
    plan = plan or SweepPlan()
    before = {id(doc): _snapshot(doc) for doc in docs}
    by_technique: dict[str, list[ResultDocument]] = {}
    for doc in docs:
        by_technique.setdefault(doc["technique"], []).append(doc)
    files_of: dict[int, dict[str, bytes]] = {}
    for entry in TECHNIQUES.values():
        group = by_technique.get(entry.name) or []
        skipped = [s for s in plan.skipped if technique_for(s.config).name == entry.name]
        if entry.conclude is not None and (group or skipped):
            _store(entry.conclude(group, skipped), group, files_of)
    if plan.conclude:
        _store(plan.conclude(docs, plan.skipped), docs, files_of)
    for doc in docs:
        if not isinstance(doc, ResultDocument) or doc.location is None or doc.run_id not in own:
            continue
        if _snapshot(doc) != before[id(doc)]:
            results.update_result(doc)
        if files_of.get(id(doc)):
            results.add_files(doc, files_of[id(doc)])


def _store(conclusion: Conclusion | None, docs: list[ResultDocument], files_of: dict[int, dict[str, bytes]]) -> None:
    """A `Conclusion` in the rows it is about (in memory; conclude_sweep writes what changed)."""
    if conclusion is None:
        return
    for doc in docs:
        if conclusion.claim is not None:
            doc["metrics"]["claim_check"] = conclusion.claim
        doc["metrics"].update(conclusion.metrics.get(doc["run_id"]) or {})  # keys over the sweep: set, or set again
        for name, value in (conclusion.sections.get(doc["run_id"]) or {}).items():
            doc.set_section(name, value)
        if conclusion.files:
            files_of.setdefault(id(doc), {}).update(conclusion.files)


def _snapshot(doc: dict) -> str:
    return json.dumps(doc.to_dict() if isinstance(doc, ResultDocument) else doc, sort_keys=True, default=str)


def store_claim(docs: list[ResultDocument], claim: dict | None, *, own: set[str] | frozenset[str]) -> None:
    """`claim` as `metrics.claim_check` of every doc in `docs`, rewritten where it changed (a claim over
    several sweeps of one command: speculate's suites); only the results of `own` (run ids the command's
    sweeps saved, `SweepPlan.written`) are rewritten, never one an earlier run wrote."""
    if claim is None:
        return
    changed = [d for d in docs if d["metrics"].get("claim_check") != claim]
    for doc in changed:
        doc["metrics"]["claim_check"] = claim
    by_dir: dict[Path, list[dict]] = {}
    for doc in changed:
        if isinstance(doc, ResultDocument) and doc.location is not None and doc.run_id in own:
            by_dir.setdefault(Path(doc.location).parent, []).append(doc)
    for out_dir, mine in by_dir.items():
        with results.runs_lock(out_dir):  # the same lock a sweep holds: no rewrite while another run saves
            for doc in mine:
                results.update_result(doc)
