"""The sweep engine: the one code path that measures configs and writes their results.

`run_configs` (engine.py) resolves and preflights every config, takes the runs directory's lock, skips
what `resume` finds done, prepares the candidates, and measures them together with the baseline in
interleaved rounds (infer_tune.rounds) when their runner times closed-loop passes: a group of
candidates as large as memory allows, each round one pass of each in shuffled order, until every
ratio's 95% interval is within the protocol's target (measure.py). Candidates whose runner does not run
in passes (an arrival trace, a server, several processes) are measured alone against the group's
baseline (baseline.py: reused, or measured and saved as a new result). A config that runs its own
workload is measured alone too. Each result is built (document.py), finished by its technique and saved
atomically, then the sweep-level hooks conclude over every row (writing.py: the only module that
writes into a runs directory). `save_rows` is the one writer for rows run_configs cannot measure (a live
endpoint's, expert-placement predictions). See docs/architecture.md, "The sweep engine".
"""

from infer_tune.sweep.baseline import ensure_baseline
from infer_tune.sweep.document import Measured, RowSpec, build_document, run_fingerprint, timing_metrics
from infer_tune.sweep.engine import preflight, resolve_configs, run_configs
from infer_tune.sweep.measure import config_workload, measure_prepared
from infer_tune.sweep.plan import Admission, Skipped, SweepPlan
from infer_tune.sweep.writing import Row, conclude_sweep, find_result, save_rows, store_claim
from infer_tune.workload import Inputs, prepare_inputs

__all__ = ["Admission", "Inputs", "Measured", "Row", "RowSpec", "Skipped", "SweepPlan", "build_document", "conclude_sweep",
           "config_workload",
           "ensure_baseline", "find_result", "measure_prepared", "preflight", "prepare_inputs", "resolve_configs",
           "run_configs", "run_fingerprint", "save_rows", "store_claim", "timing_metrics"]
