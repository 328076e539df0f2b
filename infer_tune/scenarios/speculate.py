"""`speculate`: every (draft source, K) pair against the target alone, suite by suite, in one run.

For each suite the baseline (target alone, greedy, batch size 1) and every config are measured by
the shared sweep (`run_configs`: preflight first, each result saved as it finishes, `--resume`);
the acceptance-per-position curves of the suite are plotted into each of its results
(`acceptance.png`). Then, across suites: the best lossless (draft, K) per suite or "no speedup on
this device", the claim check ("2-4x on code, TTFT unchanged, a draft about 1/10 of the target"),
the warnings the checks raised, and the rows whose output differed from the target's (which
make the command fail). `run_distill` trains a self-draft (infer_tune.tuners.speculate.distill).
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from pathlib import Path

from infer_tune import atomic
from infer_tune.document import ResultDocument, as_document
from infer_tune.errors import ConfigError
from infer_tune.runners.base import Progress
from infer_tune.scenarios.common import RunSpec, open_run
from infer_tune.sweep import SweepPlan, run_configs, store_claim
from infer_tune.tuners.speculate import EARLY_EXIT, SpeculateConfig, parse_draft
from infer_tune.tuners.speculate.claim import claim_check, lossless
from infer_tune.tuners.speculate.prepare import PROMPT_IDS_KEY, WARNINGS_KEY
from infer_tune.workload import load_prompts, prepare_inputs, select_prompts

# speculate's default engine, transformers' assisted generation (the torch engine, as speculate spells it): the
# only one early exit runs on; the other (the lean loop) takes draft_vocab
ASSISTED = SpeculateConfig.engine
WIN_THRESHOLD = 1.05  # a decode speedup below this is within run-to-run noise on a shared CPU: no win


@dataclass
class SpeculateSweep:
    """The draft sources, draft lengths, engines and suites of one `speculate` run."""

    drafts: list[str]
    draft_lengths: list[int] = field(default_factory=lambda: [2, 4, 6, 8, 10])
    suites: list[str] = field(default_factory=lambda: ["code"])
    engines: list[str] = field(default_factory=lambda: [ASSISTED])
    max_matching_ngram_size: int | None = None
    draft_vocab: int | None = None  # lean engine, draft models: cut the draft's head (SpeculateConfig)

    def configs(self) -> list[SpeculateConfig]:
        """Every (draft, engine, K), validated (early exit pairs with the hf engine only)."""
        if not self.drafts:
            raise ConfigError("speculate needs at least one draft source (a draft model, self-draft:N, "
                              "early-exit:N or prompt-lookup)")
        if not self.suites:
            raise ConfigError("speculate needs at least one suite")
        out = []
        for draft in dict.fromkeys(self.drafts):
            lookup = parse_draft(draft).kind == "prompt-lookup"
            if parse_draft(draft).kind == EARLY_EXIT and ASSISTED not in self.engines:
                raise ConfigError(f"speculate draft '{draft}' is transformers' own early exit: it needs engine 'hf' "
                                  "(self-draft:N is the same draft for the lean engine)")
            for engine in self.engines:
                if parse_draft(draft).kind == EARLY_EXIT and engine != ASSISTED:
                    continue
                cut = self.draft_vocab if engine != ASSISTED and parse_draft(draft).kind == "model" else None
                for k in self.draft_lengths:
                    out.append(SpeculateConfig(draft=draft, num_draft_tokens=k, engine=engine, draft_vocab=cut,
                                               max_matching_ngram_size=self.max_matching_ngram_size if lookup else None))
        return out


@dataclass
class SuiteOutcome:
    suite: str
    baseline: ResultDocument
    docs: list[ResultDocument]


@dataclass
class SpeculateOutcome:
    suites: list[SuiteOutcome]
    recommendations: list[dict]
    claim: dict | None
    warnings: list[str]
    mismatched: list[dict]


def check_batch_size(batch_size: int) -> None:
    if batch_size != 1:
        raise ConfigError(f"batch size {batch_size}: speculative decoding here runs one request at a time "
                          "(transformers' assisted generation and the lean loop are batch size 1)")


def run_speculate(spec: RunSpec, sweep: SpeculateSweep, progress: Progress | None = None) -> SpeculateOutcome:
    """Measure the target alone and every (draft, K) on every suite; recommend and judge the claim."""
    configs = sweep.configs()
    check_batch_size(spec.workload.batch_size)
    workloads = [dataclasses.replace(spec.workload, suite=s) for s in dict.fromkeys(sweep.suites)]
    prompts = [load_prompts(w) for w in workloads]  # every suite loads before the model does
    run = open_run(dataclasses.replace(spec, workload=workloads[0], measure_ppl=False), progress, load_suite=False)
    outcomes = []
    written: set[str] = set()
    for workload, suite_prompts in zip(workloads, prompts):
        inputs = prepare_inputs(run.loaded, workload, suite_prompts)
        run.ctx.cache[PROMPT_IDS_KEY] = [p.id for p in inputs.prompts]
        plan = SweepPlan()
        baseline, docs = run_configs(run.loaded, inputs, workload, spec.protocol, configs, run.ctx,
                                     resume=spec.resume, measure_ppl=False, plan=plan)
        written.update(plan.written)
        outcomes.append(SuiteOutcome(workload.suite, baseline, docs))
    docs = [d for o in outcomes for d in o.docs]
    claim = claim_check({o.suite: o.docs for o in outcomes})
    # across suites: each result this run saved carries the run's claim (the claims table reads it)
    docs = store_claim(docs, claim, own=written)
    concluded = iter(docs)
    for outcome in outcomes:
        outcome.docs = [next(concluded) for _ in outcome.docs]
    return SpeculateOutcome(suites=outcomes, recommendations=[recommend(o) for o in outcomes],
                            claim=claim, warnings=list(run.ctx.cache.get(WARNINGS_KEY, [])),
                            mismatched=[d for d in docs if d.metrics.get("output_mismatches")])


def recommend(outcome: SuiteOutcome) -> dict:
    """The fastest lossless (draft, K) of a suite when it beats the target alone by WIN_THRESHOLD, else none."""
    docs = [as_document(d) for d in outcome.docs]
    ranked = sorted((d for d in docs if lossless(d) and d.speedup), key=lambda d: d.speedup, reverse=True)
    best = ranked[0] if ranked else None
    if best is None or best.speedup < WIN_THRESHOLD:
        return {"suite": outcome.suite, "best": None, "verdict": "no speedup on this device",
                "best_speedup": best.speedup if best else None,
                "best_label": best.label if best else None, "threshold": WIN_THRESHOLD}
    m, config = best.metrics, best.config
    return {"suite": outcome.suite, "best": {"draft": config["draft"], "num_draft_tokens": config["num_draft_tokens"],
                                             "engine": config["engine"]},
            "best_label": best.label, "best_speedup": best.speedup,
            "throughput_ratio": m.get("throughput_ratio_vs_baseline"), "acceptance_rate": m.get("acceptance_rate"),
            "mean_acceptance_length": m.get("mean_acceptance_length"), "threshold": WIN_THRESHOLD,
            "verdict": f"use {config['draft']} with K={config['num_draft_tokens']} ({config['engine']} engine)"}


# --------------------------------------------------------------------------- distill
@dataclass
class DistillSpec:
    """Where the distilled self-draft goes and how it is trained (infer_tune.tuners.speculate.distill)."""

    layers: int
    minutes: float
    save: Path
    suites: list[str] = field(default_factory=lambda: ["code", "code-edit", "chat"])
    holdout: int = 16
    max_new_tokens: int = 64
    overwrite: bool = False
    max_prompts_per_suite: int = 1000  # more than a 2-core CPU answers in minutes; keeps prompt selection quick


@dataclass
class DistillOutcome:
    save_dir: Path
    manifest: dict


def training_prompts(loaded, spec: RunSpec, distill: DistillSpec) -> list[tuple[str, str]]:
    """(id, rendered) prompts of every suite, without each suite's first `holdout` (what a measurement with
    --limit <= holdout and the same seed picks), at most `max_prompts_per_suite` each, interleaved."""
    per_suite = []
    for suite in distill.suites:
        workload = dataclasses.replace(spec.workload, suite=suite, limit=distill.holdout + distill.max_prompts_per_suite)
        chosen, rendered = select_prompts(workload, loaded.tokenizer)
        per_suite.append([(p.id, text) for p, text in zip(chosen, rendered)][distill.holdout:])
    out = []
    for k in range(max((len(s) for s in per_suite), default=0)):
        out += [s[k] for s in per_suite if k < len(s)]
    if not out:
        raise ConfigError(f"no training prompts left in {', '.join(distill.suites)} after holding out the first "
                          f"{distill.holdout} of each")
    return out


def output_token_counts(samples, keep: int = 16384) -> dict[str, int]:
    """How often each token id appears in the target's outputs (the most frequent `keep`): what a draft
    with a pruned output vocabulary keeps."""
    from collections import Counter

    counts = Counter(t for s in samples for t in s.ids[s.prompt_tokens:])
    return {str(t): n for t, n in counts.most_common(keep)}


def run_distill(spec: RunSpec, distill: DistillSpec, progress=None) -> DistillOutcome:
    """Train a self-draft of `distill.layers` layers on the target's greedy outputs within `distill.minutes`."""
    from infer_tune.tuners.speculate import distill as train_lib
    from infer_tune.tuners.speculate.drafts import DISTILL_MANIFEST

    settings = train_lib.DistillSettings(layers=distill.layers, minutes=distill.minutes,
                                         max_new_tokens=distill.max_new_tokens, seed=spec.workload.seed)
    if distill.holdout < 0:
        raise ConfigError(f"distill holdout must be >= 0, got {distill.holdout}")
    target = Path(distill.save).expanduser()
    if target.exists() and any(target.iterdir()) and not distill.overwrite:
        raise ConfigError(f"save folder {target} already exists; allow overwriting to replace it")
    for suite in distill.suites:
        load_prompts(dataclasses.replace(spec.workload, suite=suite))
    run = open_run(dataclasses.replace(spec, measure_ppl=False), None, load_suite=False)
    loaded = run.loaded
    prompts = training_prompts(loaded, spec, distill)
    draft = train_lib.trainable_draft(loaded.model, distill.layers)
    start = time.monotonic()
    budget = distill.minutes * 60
    samples = train_lib.generate_samples(loaded.model, loaded.tokenizer, prompts, settings,
                                         start + settings.data_share * budget, progress)
    data_s = time.monotonic() - start
    stats = train_lib.train(draft, samples, settings, start + budget, progress)
    manifest = {
        "kind": "self-draft distilled on the target's greedy outputs", "target_ref": loaded.ref,
        "target_path": loaded.path, "layers": distill.layers, "minutes": distill.minutes,
        "elapsed_s": time.monotonic() - start, "data_s": data_s, "suites": distill.suites,
        "holdout_per_suite": distill.holdout, "seed": spec.workload.seed, "samples": len(samples),
        "train_prompt_ids": [s.prompt_id for s in samples], **stats,
        "output_token_counts": output_token_counts(samples),
        "settings": dataclasses.asdict(settings),
    }
    with atomic.staged_dir(target) as staging:
        draft.save_pretrained(staging)
        loaded.tokenizer.save_pretrained(staging)
        atomic.write_json(staging / DISTILL_MANIFEST, manifest)
    return DistillOutcome(save_dir=target, manifest=manifest)
