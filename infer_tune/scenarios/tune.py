"""`tune`: find the fastest configuration within a drift budget on the machine in front of it.

What is tried comes from the registry: each technique's entry says what `tune` may try of it and how it
stacks (`tune=`, tuners/base.py `Tuning`; scenarios/tune_plan.py asks). This module is the search.

1. The offers: every entry is asked for its own rows (`TuneAsk`: the objective, budgets, the loaded
   model). A technique may screen the host first (a method's kernels timed on the model's own shapes,
   interleaved with fp32) and prune what cannot win here, with the interval as the reason; its screen
   rows are the outcome's `kernel_screen`.
2. The baseline: measured in the rounds of the first group, beside the candidates (no pass of its own
   before them); alone only when nothing else was measured.
3. Single rows, the bases most promising first, each measured against the baseline in the same run and
   judged (tune_plan.judge). The most promising base is measured in one group with its likely winners
   (tune_plan.beside_method: the parts offered beside it, those that compile nothing first, then its
   compiled ones as a second group of shared rounds), sharing the baseline's passes, so the likely winner
   is measured first in the budget, before any compile, and the baseline's slow passes are paid once per
   group; the next base that may win has its stacks measured right after it (STACKED_METHODS bases in
   all). For the goodput objective a base within the budgets gets its stacks, which replay a seeded
   Poisson trace and are judged on their goodput against the baseline serving the same trace one
   request at a time (scenarios/tune_goodput.py, added by the sweep engine's `conclude`).
   Before each candidate the remaining time budget is checked against what the costliest similar
   candidate cost; what does not fit is skipped and listed; rounds past the floor end once it is spent.
4. The winner from intervals (tune_plan.decide: the highest lower bound of the objective's 95%
   interval; candidates overlapping it are measured again together in shared rounds while the budget
   allows, and a winner still not separated is said so), else the baseline; a recipe that reproduces
   it (`bench --recipe`), its saved weights copied out of the scratch area, and how it compares with the
   reference rows the registry offers (llama.cpp at its best: its fastest format made from the checkpoint
   the search quantized, measured after the search when it can run here). The leader after every measurement is kept (`TuneOutcome.leaders`): the winner was
   found when it became the leader for good (`winner_found_s`).
"""

from __future__ import annotations

import itertools
import shutil
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

from infer_tune.document import ResultDocument, as_document
from infer_tune.errors import InferTuneError
from infer_tune.report.recommend import OBJECTIVES as OBJECTIVE_KEYS
from infer_tune.runners.base import Progress
from infer_tune.scenarios.common import RunSpec, open_run
from infer_tune.scenarios.tune_plan import (
    Candidate,
    Host,
    TuneSpec,
    beside_method,
    decide,
    decode_tok_s,
    judge,
    may_stack,
    singles,
    slo_text,
    stack_candidates,
)
from infer_tune.sweep import SweepPlan, ensure_baseline, run_configs
from infer_tune.tuners.base import Offer

COMPILE_ALLOWANCE_S = 150.0  # first guess of a compiled candidate's extra cost (2 cores); refined once measured
STACKED_METHODS = 2  # the first bases that may win get their stacks (every entry's parts on them)


@dataclass
class TuneOutcome:
    baseline: ResultDocument
    winner: ResultDocument
    candidates: list[Candidate]
    reference: ResultDocument | None
    screen: dict
    tune_dir: Path
    recipe_path: Path
    command: str
    weights_dir: Path | None
    versus_reference: dict | None
    elapsed_s: float
    notes: list[str] = field(default_factory=list)
    objective: str = "decode"
    serving: dict | None = None  # goodput: the load offered and the SLOs (`serving_terms`)
    leaders: list[dict] = field(default_factory=list)  # after each measurement: {"s", "leader"} (None: none yet)

    def tried(self) -> list[dict]:
        return [c.summary() for c in self.candidates]

    @property
    def winner_label(self) -> str | None:
        """The winning candidate's label as `leaders` names it (its config as tried; the saved row's label has
        the choices resolved on this host, e.g. `auto` kernels named). None when the baseline won."""
        return winner_label(self.candidates, self.winner)

    @property
    def winner_found_s(self) -> float | None:
        """Seconds into the search from when the winner led for good: the first of the measurements after
        which it was the leader every time (None: the baseline won)."""
        label = self.winner_label
        if label is None:
            return None
        found = None
        for entry in self.leaders:
            if entry["leader"] != label:
                found = None
            elif found is None:
                found = entry["s"]
        return found

    def to_dict(self) -> dict:
        """The --json document: `winner` (a result document) and `tried`, plus where things are."""
        return {"winner": self.winner, "tried": self.tried(), "baseline_run_id": self.baseline.run_id,
                "reference": self.reference, "versus_reference": self.versus_reference,
                "kernel_screen": self.screen, "recipe": str(self.recipe_path), "command": self.command,
                "weights_dir": str(self.weights_dir) if self.weights_dir else None, "elapsed_s": self.elapsed_s,
                "winner_found_s": self.winner_found_s, "leaders": self.leaders,
                "notes": self.notes, "objective": self.objective, "serving": self.serving}


def serving_terms(tune: TuneSpec, requests: int) -> dict | None:
    """What the goodput objective measured on (None for the other objectives)."""
    if tune.objective != "goodput":
        return None
    return {"rate_req_s": tune.rate, "requests": requests, "arrivals": f"Poisson, seed {tune.seed}",
            "slo": tune.slo.to_dict(),
            "goodput": "requests per second meeting every SLO (TTFT from arrival, TPOT) over the replay's duration",
            "baseline": "the plain model serving the same trace one request at a time, first come first served"}


class Leader(NamedTuple):
    """The eligible candidate leading so far and the bounds of its objective's 95% interval."""

    label: str
    low: float
    high: float


RIVAL_ROUNDS = 4  # rounds past the floor a group's candidates get to separate from one another (`decided`)


def _plan(tune: TuneSpec, leader: Leader | None = None, *, settle: bool = True,
          budget: Budget | None = None) -> SweepPlan | None:
    """What tune asks of the sweep engine beyond its configs: for the goodput objective, the goodput keys
    under its SLOs, taken against the baseline the rows were measured beside (scenarios/tune_goodput.py);
    for the others, rounds that end once the candidate's place in the decision is settled by its objective
    interval (`decided`; `leader`: the eligible leader's label and interval bounds, None before one exists;
    for RIVAL_ROUNDS rounds past the floor also against the group's other candidates); none with `settle`
    off (contenders measured again together must separate from one another). With a `budget`, rounds
    past the floor also end once it is spent: a row that started within it ends at most a round after."""
    def spent() -> str | None:
        return f"the time budget ({budget.seconds:.0f} s) is spent" if budget is not None and budget.spent else None

    if tune.objective == "goodput":
        from infer_tune.scenarios.tune_goodput import goodput_keys

        plan = SweepPlan(stop_rounds=lambda found: spent())
        plan.conclude = lambda docs, _: goodput_keys(docs, plan.baseline, tune.slo, tune.rate)
        return plan
    if not settle:
        return None
    calls = itertools.count()
    key = OBJECTIVE_KEYS[tune.objective]
    return SweepPlan(stop_rounds=lambda found: decided(key, leader, found, rivals=next(calls) < RIVAL_ROUNDS)
                     or spent())


def decided(key: str, leader: Leader | None, found: dict[str, dict], *, rivals: bool = False) -> str | None:
    """Why more rounds would not change what the search does with every candidate of a group of rounds
    (None while one is still open). A candidate is settled when the 95% interval of its `key` ratio over
    the baseline lies wholly
    - below 1: it does not beat the baseline, so it cannot be eligible;
    - below the leader's lower bound: it cannot win;
    - above 1 and above the leader's upper bound (or above 1 with no leader yet): it beats the baseline and
      leads, separated from the rest so far.
    With `rivals`, the group's other candidates above the baseline count as leaders too: a group measured
    together (a base and its likely stacks) goes on until its best is separated from
    the others, instead of stopping once each is above the baseline (`_plan` allows RIVAL_ROUNDS such rounds).
    What is left open is only where an interval overlaps 1 or a leader's: those rounds go on to the target
    or the budget, and candidates that end overlapping the winner are measured again together (`_decide`)."""
    bounds = {}
    for name, intervals in found.items():
        interval = intervals.get(key)
        if not interval:
            return None
        bounds[name] = tuple(interval["ci95"])
    why = []
    for name, (low, high) in bounds.items():
        ahead = [(f"the leader {leader.label}", leader.low, leader.high)] if leader is not None else []
        if rivals:
            ahead += [(other, b[0], b[1]) for other, b in bounds.items() if other != name and b[1] >= 1.0]
        best = max(ahead, key=lambda a: a[1], default=None)
        top = max(ahead, key=lambda a: a[2], default=None)
        if high < 1.0:
            why.append(f"{key} at most {high:.2f} (95% interval): not above the baseline")
        elif best is not None and high < best[1]:
            why.append(f"{key} at most {high:.2f} (95% interval), below {best[0]}'s {best[1]:.2f}")
        elif low > 1.0 and (top is None or low > top[2]):
            past = "" if top is None else f" and {top[0]}'s upper bound {top[2]:.2f}"
            why.append(f"{key} at least {low:.2f} (95% interval), above the baseline{past}")
        else:
            return None
    return "; ".join(why) if why else None


class Budget:
    """Wall-clock budget of the search, and what a candidate is expected to cost."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.start = time.monotonic()
        self.costs: list[float] = []
        self.compile_costs: list[float] = []

    @property
    def elapsed(self) -> float:
        return time.monotonic() - self.start

    def expected(self, cand: Candidate) -> float:
        """The costliest similar candidate so far (compiled ones apart): a median let a 2-core run start a
        row at 1088 s of 1200 expecting 95 s that took 203 s (a method without int8 activations decodes
        slower than the shares of the first group it was compared with)."""
        base = max(self.costs, default=0.0)
        if cand.compiles:
            return max(self.compile_costs) if self.compile_costs else base + COMPILE_ALLOWANCE_S
        return base

    @property
    def spent(self) -> bool:
        return self.elapsed >= self.seconds

    def fits(self, cand: Candidate) -> bool:
        return self.fits_all([cand])

    def fits_all(self, cands: list[Candidate]) -> bool:
        """Whether `cands` measured one after another would end within the budget (a group in shared rounds
        costs less: one baseline pass per round for all of them)."""
        return self.elapsed + sum(self.expected(c) for c in cands) <= self.seconds

    def record(self, cands: list[Candidate], seconds: float) -> None:
        """What a group of candidates cost, counted as an equal share per candidate."""
        for cand in cands:
            (self.compile_costs if cand.compiles else self.costs).append(seconds / len(cands))


def run_tune(spec: RunSpec, tune: TuneSpec, *, progress: Progress | None = None) -> TuneOutcome:
    """The search (module docstring); every measured row is a saved result in `spec.out_dir`."""
    check_serving(spec, tune)
    budget = Budget(tune.budget_s)
    note = progress or (lambda stage, done, total: None)
    run = open_run(spec, progress)
    ctx = run.ctx
    prompt_tokens = [int(b["attention_mask"].sum()) for b in run.inputs.batches]
    ctx.cache["prefill_rows"] = max(1, int(statistics.median(prompt_tokens))) if prompt_tokens else 64
    tune_dir = Path(spec.out_dir) / time.strftime("tune-%Y%m%d-%H%M%S")
    scratch = Path(tempfile.mkdtemp(prefix="infer-tune-tune-"))
    ctx.scratch_dir = scratch
    try:
        stage = "tune: asking each technique what to try here (kernel screens)"
        note(stage, 0, 1)
        host = Host(run.loaded, ctx.cache["prefill_rows"], tuple(prompt_tokens), spec.workload.max_new_tokens)
        offered = singles(tune, host)
        screen = offered.screen
        note(stage, 1, 1)
        notes: list[str] = []
        baseline: ResultDocument | None = None  # measured in the rounds of the first group (no pass of its own before)
        terms = serving_terms(tune, len(run.inputs.prompts))
        if terms is not None:
            notes.append(f"goodput: {terms['goodput']}, SLOs {slo_text(tune)}; a seeded Poisson trace of "
                         f"{terms['requests']} requests (one per prompt) at {tune.rate:g} req/s; baseline: "
                         f"{terms['baseline']}, from its own times measured in the same rounds")
        candidates = offered.candidates
        queue = [c for c in candidates if c.status == "pending"]
        leaders: list[dict] = []
        stacked = 0
        asked_beside = False
        done = 0
        while queue:
            cand = queue.pop(0)
            done += 1
            total = done + len(queue)
            if not budget.fits(cand):
                cand.status = "skipped"
                cand.reason = (f"time budget: {budget.elapsed:.0f} s used of {budget.seconds:.0f}, this one expected "
                               f"to take {budget.expected(cand):.0f} s")
                continue
            group, later = [cand], []
            together = [c for c in queue if cand.rounds_with and c.rounds_with == cand.rounds_with]
            if together and budget.fits_all([cand, *together]):  # queued to share rounds (beside_method)
                group += together
                queue = [c for c in queue if c not in together]
                total += len(together)
            if not asked_beside and cand.base:  # the most promising base
                asked_beside = True
                beside, later = beside_method(tune, cand, host)
                if beside and budget.fits_all([cand, *beside]):
                    group += beside
                    candidates += beside
                    total += len(beside)
            leader = _leader(candidates, tune.objective)
            shown = f"{leader.label} ({OBJECTIVE_KEYS[tune.objective]} [{leader.low:.2f}, {leader.high:.2f}])" \
                if leader else "the baseline"
            along = f" with {len(group) - 1} more in the same rounds" if len(group) > 1 else ""
            note(f"tune: trying {cand.label}{along} ({done}/{total}), leading so far {shown}", done - 1, total)
            baseline = _measure(group, run, spec, tune, ctx, budget, leader=leader) or baseline
            done += len(group) - 1
            leader = _leader(candidates, tune.objective)
            leaders.append({"s": budget.elapsed, "leader": leader.label if leader else None})
            if may_stack(cand, tune) and cand.base and stacked < STACKED_METHODS:
                # measured beside it already: only the rest (`later`); else all of its stacks
                stacks = later if len(group) > 1 else stack_candidates(tune, [cand], first=stacked == 0, host=host)
                stacked += 1
                candidates += stacks
                queue[:0] = stacks  # the stacks of a method that may win are measured next
        if baseline is None:  # nothing was measured (every candidate pruned or skipped): the baseline alone
            baseline, _, _ = ensure_baseline(run.loaded, run.inputs, spec.workload, spec.protocol, ctx,
                                             reuse=spec.resume, measure_ppl=spec.measure_ppl)
            baseline = as_document(baseline)
        reference, found = _reference(offered.references, run, spec, tune, ctx)
        notes[:0] = found
        winner = _decide(candidates, baseline, run, spec, tune, ctx, budget, notes, note)
        final = winner_label(candidates, winner)
        if not leaders or leaders[-1]["leader"] != final:
            leaders.append({"s": budget.elapsed, "leader": final})
        if tune.objective == "goodput" and not any(c.doc and c.doc.metric("goodput_req_s") is not None
                                                   for c in candidates):
            notes.append("no batched stack served the trace: they stack on the bases within the budgets (none "
                         "was measured within them, or the time budget ran out first)")
        if winner is baseline:
            notes.append("nothing measured beat the baseline within the budgets; ship the plain model")
        weights = _copy_weights(winner, tune_dir)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    recipe_path = write_recipe(tune_dir, winner, spec)
    command = f"infer-tune bench --recipe {recipe_path} --out {spec.out_dir}"
    return TuneOutcome(baseline=baseline, winner=winner, candidates=candidates, reference=reference, screen=screen,
                       tune_dir=tune_dir, recipe_path=recipe_path, command=command, weights_dir=weights,
                       versus_reference=versus_reference(winner, reference), elapsed_s=budget.elapsed, notes=notes,
                       objective=tune.objective, serving=terms, leaders=leaders)


def check_serving(spec: RunSpec, tune: TuneSpec, *, remote: bool | None = None) -> None:
    """What the goodput objective needs, checked before the model loads: the batched stacks (the slot
    engine compiles its step), a baseline that serves one request at a time, and the sweep engine here
    (its goodput keys are taken beside the baseline's rounds, which a remote executor does not return).
    `remote`: whether a remote executor will run it (default: whether one is in scope now)."""
    from infer_tune import executors
    from infer_tune.errors import ConfigError

    if tune.objective != "goodput":
        return
    if not tune.compile:
        raise ConfigError("tune --objective goodput measures batched stacks on the slot engine, which compiles its "
                          "decode step: drop --no-compile")
    if spec.workload.batch_size != 1:
        raise ConfigError(f"tune --objective goodput serves the baseline one request at a time: --batch-size must be "
                          f"1, got {spec.workload.batch_size}")
    if remote is None:
        remote = executors.current() is not None
    if remote:
        raise ConfigError("tune --objective goodput runs on the local executor only (--executor local)")


def _decide(candidates: list[Candidate], baseline: ResultDocument, run, spec: RunSpec, tune: TuneSpec, ctx,
            budget: Budget, notes: list[str], note) -> ResultDocument:
    """The winner from intervals. When eligible candidates' intervals overlap the leader's, the
    contenders are measured again together, in shared interleaved rounds with the baseline, while the
    budget allows; still overlapping, the highest lower bound wins and the notes say it is not separated."""
    winner, contenders = decide(candidates, baseline, tune.objective)
    if len(contenders) > 1:
        expected = sum(budget.expected(c) for c in contenders)
        if budget.elapsed + expected <= budget.seconds:
            note(f"tune: {len(contenders)} contenders overlap the leader; measuring them together", 0, 1)
            started = time.monotonic()
            from infer_tune import executors

            try:
                if (executor := executors.current()) is not None:  # e.g. Ray: together on one node
                    _, docs = executor.run_together(spec, [c.config for c in contenders])
                else:
                    _, docs = run_configs(run.loaded, run.inputs, spec.workload, spec.protocol,
                                          [c.config for c in contenders], ctx, measure_ppl=spec.measure_ppl,
                                          plan=_plan(tune, settle=False))
            except InferTuneError as exc:
                notes.append(f"contenders not measured again: {exc}")
            else:
                for cand, doc in zip(contenders, docs):
                    cand.doc, cand.measured_at_s = as_document(doc), budget.elapsed
                    _apply(cand, judge(doc, tune, lossless_claimed=cand.lossless))
                winner, contenders = decide(candidates, baseline, tune.objective)
            budget.costs.append(time.monotonic() - started)
        else:
            notes.append(f"{len(contenders)} contenders overlap but the budget has no room to measure them together")
    if len(contenders) > 1:
        notes.append("the winner is not separated from " + ", ".join(c.label for c in contenders[1:])
                     + " (95% intervals overlap); the highest lower bound was taken")
    return winner


def _leader(candidates: list[Candidate], objective: str) -> Leader | None:
    """The eligible candidate leading so far (the highest lower bound of its objective interval)."""
    from infer_tune.report.recommend import interval_of

    scored = [(interval_of(c.doc, objective), c.label) for c in candidates if c.eligible and c.doc is not None]
    scored = [(iv[0], iv[2], label) for iv, label in scored if iv]
    if not scored:
        return None
    low, high, label = max(scored)
    return Leader(label, low, high)


def winner_label(candidates: list[Candidate], winner: ResultDocument) -> str | None:
    """The label of the candidate whose measured row is `winner` (None: the baseline)."""
    winner = as_document(winner)
    return next((c.label for c in candidates if c.doc is not None and winner.technique != "baseline"
                 and as_document(c.doc).run_id == winner.run_id), None)


def _measure(group: list[Candidate], run, spec: RunSpec, tune: TuneSpec, ctx, budget: Budget,
             leader: Leader | None = None) -> ResultDocument | None:
    """Measure candidates against the baseline, together in shared rounds (saved results), and judge each;
    failures are listed (a group that fails is measured again one candidate at a time, so one that cannot
    run here does not take the others with it). The rounds end once every interval settles its
    candidate's place against the baseline and the `leader` (`decided`). Returns the baseline of those
    rounds (None when nothing was measured)."""
    from infer_tune import executors

    started = time.monotonic()
    try:
        if (executor := executors.current()) is not None:  # e.g. Ray: measured with its node's baseline there
            baseline, docs = executor.run_configs(spec, [c.config for c in group])
        else:
            baseline, docs = run_configs(run.loaded, run.inputs, spec.workload, spec.protocol, [c.config for c in group],
                                  ctx, resume=spec.resume, reuse_baseline=True, measure_ppl=spec.measure_ppl,
                                  plan=_plan(tune, leader, budget=budget))
    except InferTuneError as exc:  # a candidate this model or host cannot run: listed, not fatal
        failed = exc
    else:
        failed = None
    budget.record(group, time.monotonic() - started)
    if failed is not None:
        if len(group) > 1:
            found = [_measure([cand], run, spec, tune, ctx, budget, leader=leader) for cand in group]
            return next((b for b in reversed(found) if b is not None), None)
        group[0].status, group[0].reason = "failed", str(failed)
        return None
    for cand, doc in zip(group, docs):
        cand.doc, cand.status, cand.measured_at_s = as_document(doc), "measured", budget.elapsed
        _apply(cand, judge(cand.doc, tune, lossless_claimed=cand.lossless))
    return as_document(baseline)


def _apply(cand: Candidate, verdict) -> None:
    cand.eligible, cand.within_budget = verdict.eligible, verdict.within_budget
    cand.reason = "; ".join(verdict.reasons) or None


def _reference(references: list[Offer], run, spec: RunSpec, tune: TuneSpec,
               ctx) -> tuple[ResultDocument | None, list[str]]:
    """The first reference row the registry offers (another engine on the same weights file), measured like every row
    (None, with why, when none can run here)."""
    if not tune.reference:
        return None, []
    notes = []
    for offer in references:
        name = offer.config.label()
        if offer.reason:
            notes.append(f"reference {name} not measured: {offer.reason}")
            continue
        try:
            _, docs = run_configs(run.loaded, run.inputs, spec.workload, spec.protocol, [offer.config], ctx,
                                  resume=spec.resume, reuse_baseline=True, measure_ppl=False)
        except InferTuneError as exc:
            notes.append(f"reference {name} not measured: {exc}")
            continue
        return as_document(docs[0]), notes
    return None, notes


def versus_reference(winner: ResultDocument, reference: ResultDocument | None) -> dict | None:
    """Decode tok/s and TTFT of the winner against the reference row's in the same run."""
    if reference is None:
        return None
    winner, reference = as_document(winner), as_document(reference)
    ours, theirs = decode_tok_s(winner), decode_tok_s(reference)
    ttft_ours, ttft_theirs = winner.ttft_p50_ms, reference.ttft_p50_ms
    decode_ratio = ours / theirs if ours and theirs else None
    ttft_ratio = ttft_ours / ttft_theirs if ttft_ours and ttft_theirs else None
    return {"decode_tok_s": ours, "reference_decode_tok_s": theirs, "decode_ratio": decode_ratio,
            "ttft_ms": ttft_ours, "reference_ttft_ms": ttft_theirs, "ttft_ratio": ttft_ratio,
            "beat_decode": decode_ratio is not None and decode_ratio >= 1.0,
            "ttft_within_2x": ttft_ratio is not None and ttft_ratio <= 2.0,
            "reference_bleu_drift": reference.metrics.get("bleu_drift"),
            "reference_format": reference.metrics.get("gguf_format"),
            "reference_llama_cpp": reference.metrics.get("llama_cpp")}


def _copy_weights(winner: ResultDocument, tune_dir: Path) -> Path | None:
    """The winner's saved checkpoint (`metrics.save_dir`), copied out of the scratch area (None when it has none)."""
    saved = winner.metrics.get("save_dir")
    if not saved or not Path(saved).is_dir():
        return None
    target = tune_dir / "weights"
    shutil.copytree(saved, target, dirs_exist_ok=True)
    return target


def recipe_entry(config: dict) -> dict:
    """A config's dict as a recipe `configs` entry (`technique:` + fields; stacks nest their parts)."""
    entry = {k: v for k, v in config.items() if k not in ("kind", "technique")}
    if "configs" in entry:
        entry["configs"] = [recipe_entry(part) for part in entry["configs"]]
    return {"technique": config.get("technique"), **entry}


def write_recipe(tune_dir: Path, winner: ResultDocument, spec: RunSpec) -> Path:
    """A recipe that reproduces the winner with `infer-tune bench --recipe` (the baseline when it won)."""
    import dataclasses

    import yaml

    from infer_tune import atomic

    configs = [] if winner.technique == "baseline" else [recipe_entry({"technique": winner.technique, **winner.config})]
    doc = {"description": f"tune winner: {winner.label} ({winner.technique})",
           "model": spec.model, "workload": spec.workload.to_dict(),
           "protocol": dataclasses.asdict(spec.protocol), "configs": configs}
    tune_dir.mkdir(parents=True, exist_ok=True)
    path = tune_dir / "recipe.yaml"
    atomic.write_text(path, yaml.safe_dump(doc, sort_keys=False))
    return path
