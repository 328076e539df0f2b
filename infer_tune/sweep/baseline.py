"""The plain model's row: reused from the runs directory when one of the same fingerprint is there, or
measured alone and saved as a new result (`ensure_baseline`); a saved baseline is never rewritten."""

from __future__ import annotations

from infer_tune import models, results
from infer_tune.document import ResultDocument
from infer_tune.runners import PreparedModel
from infer_tune.sweep.document import run_fingerprint
from infer_tune.sweep.measure import measure_prepared
from infer_tune.sweep.writing import find_result, save_result
from infer_tune.tuners.base import RunContext
from infer_tune.workload import Inputs, Protocol, Workload


def ensure_baseline(
    loaded: models.LoadedModel,
    inputs: Inputs,
    workload: Workload,
    protocol: Protocol,
    ctx: RunContext,
    *,
    reuse: bool = True,
    measure_ppl: bool = True,
    execute: bool = False,
) -> tuple[ResultDocument, list[dict], bool]:
    """Reuse a baseline of the same fingerprint from `ctx.out_dir`, or measure and save one.

    Returns (doc, outputs, reused).
    """
    fp = run_fingerprint(loaded, "baseline", {}, workload, ctx.env, execute, protocol=protocol,
                         measure_ppl=measure_ppl)
    with results.runs_lock(ctx.out_dir):  # re-entrant: a sweep holds it already; `tune` calls this alone
        if reuse and (found := find_result(ctx.out_dir, fp, "baseline")) is not None:
            return found, results.load_outputs(found), True
        prepared = PreparedModel(model=loaded.model, tokenizer=loaded.tokenizer, label="baseline", device=ctx.device)
        doc, outputs = measure_prepared(loaded, prepared, inputs, workload, protocol, technique="baseline", config={},
                                        env=ctx.env, measure_ppl=measure_ppl, execute=execute, progress=ctx.progress)
        save_result(ctx.out_dir, doc, outputs)
        return doc, outputs, False
