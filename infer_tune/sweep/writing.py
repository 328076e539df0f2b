"""Everything the sweep engine writes into a runs directory, and only there: a result saved atomically
(`save_result`), rows measured elsewhere saved under the runs lock (`save_rows`), the sweep-level
hooks' conclusions saved beside the results the sweep saved (`conclude_sweep`, `store_claim`: a
conclusion file, never a change to result.json), never beside one an earlier run wrote; and the lookup of a finished result by fingerprint (`find_result`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from infer_tune import results
from infer_tune.document import ResultDocument, as_document
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
                   own: set[str] | frozenset[str]) -> list[ResultDocument]:
    """Each technique's `conclude` over its results of the sweep and the configs it skipped, then the plan's
    own `conclude` over every result, each `Conclusion` merged into the rows it is about. A saved row is never
    modified: each concluded row is a new document (ResultDocument.with_conclusion), returned in the order of
    `docs`, and its conclusion is saved beside its `result.json` (results.save_conclusion), with the
    conclusion's files, only for the results this sweep saved (`own`: their run ids). A result read back from
    an earlier run (`resume`, a reused baseline, a landed folder that was there) gets nothing on disk."""
    load_techniques()
    plan = plan or SweepPlan()
    docs = [as_document(d) for d in docs]  # the hooks read typed documents (a caller's hand-made rows too)
    files_of: dict[str, dict[str, bytes]] = {}
    for entry in TECHNIQUES.values():
        group = [i for i, d in enumerate(docs) if d["technique"] == entry.name]
        skipped = [s for s in plan.skipped if technique_for(s.config).name == entry.name]
        if entry.conclude is not None and (group or skipped):
            _store(entry.conclude([docs[i] for i in group], skipped), docs, group, files_of, entry.name)
    if plan.conclude:
        _store(plan.conclude(list(docs), plan.skipped), docs, list(range(len(docs))), files_of, "the sweep's plan")
    for doc in docs:
        if _saved_by(doc, own):
            results.save_conclusion(doc)
            if files_of.get(doc.run_id):
                results.add_files(doc, files_of[doc.run_id])
    return docs


def _saved_by(doc: ResultDocument, own: set[str] | frozenset[str]) -> bool:
    return isinstance(doc, ResultDocument) and doc.location is not None and doc.run_id in own


def _store(conclusion: Conclusion | None, docs: list[ResultDocument], indices: list[int],
           files_of: dict[str, dict[str, bytes]], source: str) -> None:
    """A `Conclusion` merged into the rows `docs[i]` it is about (each replaced by its concluded document;
    conclude_sweep saves what changed)."""
    if conclusion is None:
        return
    for i in indices:
        doc = docs[i]
        doc = _concluded(doc, {**({"claim_check": conclusion.claim} if conclusion.claim is not None else {}),
                               **(conclusion.metrics.get(doc["run_id"]) or {})},  # keys over the sweep: set again
                         conclusion.sections.get(doc["run_id"]) or {}, source)
        docs[i] = doc
        if conclusion.files:
            files_of.setdefault(doc["run_id"], {}).update(conclusion.files)


def _concluded(doc: ResultDocument | dict, metrics: dict, sections: dict, source: str) -> ResultDocument:
    doc = as_document(doc)
    if doc.frozen:
        return doc.with_conclusion(metrics, sections, source=source)
    doc.set_sweep_metrics(metrics, source=source)  # a row not saved (a caller's own document): set on it
    for name, value in sections.items():
        doc.set_section(name, value)
    return doc


def store_claim(docs: list[ResultDocument], claim: dict | None, *,
                own: set[str] | frozenset[str]) -> list[ResultDocument]:
    """`docs` with `claim` as `metrics.claim_check` of each (a claim over several sweeps of one command:
    speculate's suites): new documents where it changed, in order; saved in their conclusion only for the
    results of `own` (run ids the command's sweeps saved, `SweepPlan.written`), never one an earlier run wrote."""
    if claim is None:
        return list(docs)
    out = [_concluded(d, {"claim_check": claim}, {}, "the command's claim") for d in docs]
    by_dir: dict[Path, list[ResultDocument]] = {}
    for before, doc in zip(docs, out):
        if doc is not before and _saved_by(doc, own):
            by_dir.setdefault(Path(doc.location).parent, []).append(doc)
    for out_dir, mine in by_dir.items():
        with results.runs_lock(out_dir):  # the same lock a sweep holds: no write while another run saves
            for doc in mine:
                results.save_conclusion(doc)
    return out
