"""Whether two results are the same measurement but for the change under test (report/compare.py's
module docstring lists what must match; docs/compare.md, "Like with like")."""

from __future__ import annotations

from collections.abc import Sequence

from infer_tune.document import ResultDocument
from infer_tune.errors import InferTuneError


class MismatchError(InferTuneError):
    """Results of different suites or models compared without --allow-mismatch."""


def hardware(doc: ResultDocument) -> tuple | None:
    """The machine a result ran on (CPU, flags, cores, RAM, accelerator), None when it recorded none."""
    env = doc.get("env") or {}
    values = tuple(env.get(k) if not isinstance(env.get(k), list) else tuple(env[k])
                   for k in ("cpu", "cpu_flags", "cores", "ram_bytes", "accelerator"))
    return values if any(v is not None for v in values) else None


def _identity(doc: ResultDocument, block: str, id_key: str, plain_key: str) -> object:
    """A content id when the result recorded one, else the plain name (older results)."""
    part = doc.get(block) or {}
    return part.get(id_key) or part.get(plain_key)


# what must be equal for a comparison to mean anything: name -> value of a document
MATCH = {
    "suite": lambda d: _identity(d, "workload", "suite_id", "suite"),
    "model": lambda d: _identity(d, "model", "content_id", "ref"),
    "max_new_tokens": lambda d: d["workload"].get("max_new_tokens"),
    "batch_size": lambda d: d["workload"].get("batch_size"),
    "limit": lambda d: d["workload"].get("limit"),
    "dtype": lambda d: d["model"].get("dtype"),
    "threads": lambda d: d["env"].get("threads"),
    "machine": hardware,
}


# two servers measured over HTTP each have their own weights' format, dtype, threads and machine:
# comparing one deployment with another is the point, so those are not compared when BOTH results are
# endpoint runs. One side's `runner` is only its own claim: an in-process run against an endpoint run
# (or a result that merely says `runner: endpoint`) is held to every check (--allow-mismatch to proceed).
SERVER_SIDE = ("model", "dtype", "threads", "machine")


def mismatches(base: ResultDocument, cand: ResultDocument) -> list[str]:
    """Each way `cand` was measured differently from `base` (MATCH), as a short phrase."""
    found = []
    remote = base.get("runner") == "endpoint" and cand.get("runner") == "endpoint"
    if (base.get("runner") == "endpoint") != (cand.get("runner") == "endpoint"):
        found.append(f"runner {cand.get('runner')!r} vs {base.get('runner')!r} (a live server against an in-process run)")
    for what, get in MATCH.items():
        if remote and what in SERVER_SIDE:
            continue
        b, c = get(base), get(cand)
        if b != c:
            found.append("another machine (CPU, cores, RAM or accelerator)" if what == "machine"
                         else f"{what} {c!r} vs {b!r}")
    return found


def check_match(base: ResultDocument, candidates: Sequence[ResultDocument], *, allow_mismatch: bool = False) -> list[str]:
    """Refuse (MismatchError) a candidate measured differently from the base (suite, model, max new
    tokens, batch size, limit, dtype, threads, machine); with `allow_mismatch`, return one loud
    warning per such candidate instead."""
    warnings = []
    for cand in candidates:
        found = mismatches(base, cand)
        if not found:
            continue
        text = f"{cand['run_id']} was measured differently from the base: {'; '.join(found)}"
        if not allow_mismatch:
            raise MismatchError(f"{text}; compare like with like, or pass --allow-mismatch")
        warnings.append(f"{text}; its deltas mix that difference in")
    return warnings
