"""Speculative decoding: a draft proposes K tokens, the target verifies them in one forward pass.

Draft sources (`SpeculateConfig.draft`): another model (same tokenizer, or another one through
transformers' universal assisted generation), a self-draft cut from the target's first N layers,
transformers' early-exit self-speculation, and n-gram prompt lookup; `distill` trains a self-draft
on the target's own greedy outputs. Two engines run the loop: transformers' assisted generation
(`hf`) and infer-tune's lean loop (`lean`). Under greedy decoding both must reproduce the target's
own output token for token; the result's `output_mismatches` says whether they did.
The sweep, the per-suite recommendation and the claim check: infer_tune.scenarios.speculate.
"""

from __future__ import annotations

import dataclasses

from infer_tune.metrics.schema import LEAN_LOOP_KEYS
from infer_tune.tuners.base import Conclusion, MeasuredRow, RunContext, register_technique
from infer_tune.tuners.speculate import claim, plots
from infer_tune.tuners.speculate.config import (
    EARLY_EXIT,
    HF_ENGINE,
    LEAN_ENGINE,
    PROMPT_LOOKUP,
    SELF_DRAFT,
    DraftSource,
    SpeculateConfig,
    parse_draft,
    parse_draft_lengths,
)
from infer_tune.tuners.speculate.prepare import annotate, preflight, prepare
from infer_tune.tuners.speculate.report import report_columns

__all__ = ["EARLY_EXIT", "HF_ENGINE", "LEAN_ENGINE", "PROMPT_LOOKUP", "SELF_DRAFT", "DraftSource", "SpeculateConfig", "parse_draft",
           "parse_draft_lengths"]



def _resolve(config: SpeculateConfig, ctx: RunContext) -> SpeculateConfig:
    """Record which weights a draft directory holds (its digest goes into the result and the fingerprint)."""
    from infer_tune.tuners.speculate.drafts import draft_digest

    if config.source.kind != "model":
        return config
    return dataclasses.replace(config, draft_digest=draft_digest(config.source.ref))


def _finish(row: MeasuredRow) -> None:
    """Losslessness: greedy speculative decoding reproduces the target-alone outputs token for token."""
    annotate(row.doc, row.earlier)


def _conclude(docs: list, skipped: list) -> Conclusion:
    """The claim over the sweep's drafts (each code suite's fastest lossless draft) and the acceptance figure."""
    return Conclusion(claim=claim.summarize(docs), files=plots.plots(docs))


# the metrics a speculate row carries beyond the core (its namespace: metrics/schema.py)
METRIC_KEYS = {
    **dict.fromkeys(("draft_kind", "draft_path", "draft_params", "draft_layers", "draft_tokenizer", "draft_target_param_ratio",
                     "draft_distilled", "draft_train_overlap", "draft_train_prompts", "draft_vocab_coverage",
                     "draft_vocab_kept", "target_params", "engine", "speculate_native_fallback", "speculate_verify",
                     "batch_size_note"), "the draft and how the loop ran"),
    **dict.fromkeys(("acceptance_by_position", "acceptance_rate", "accepted_by_position", "proposed_by_position",
                     "mean_acceptance_length", "draft_tokens_accepted", "draft_tokens_proposed", "tokens_emitted",
                     "tokens_per_target_pass", "target_forward_passes", "verify_passes", "multi_token_steps",
                     "draft_steps", "draft_step_ms"), "the loop's counters"),
    **dict.fromkeys(("draft_ms_per_round", "draft_forward_ms_per_round", "verify_ms_per_round", "overhead_ms_per_round",
                     "draft_time_share", "draft_forward_time_share", "verify_time_share", "overhead_time_share"),
                    "where a round's time went"),
    "lossless": "the outputs equal the target alone's, token for token",
    **LEAN_LOOP_KEYS,
}
register_technique(SpeculateConfig, runner="speculative", resolve=_resolve, preflight=preflight, finish=_finish,
                   conclude=_conclude, measure_ppl=False, phase=2, report_columns=report_columns,
                   metric_keys=METRIC_KEYS)(prepare)
