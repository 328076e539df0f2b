"""The speculate registry entry: resolve the draft source, check it, and hand the runner a counted loop.

Both engines leave the target's weights untouched (greedy speculative decoding changes how many
tokens one target pass yields, never which tokens): `hf` passes the draft to transformers'
`generate` (assistant_model / prompt_lookup_num_tokens / assistant_early_exit, plus the two
tokenizers for universal assisted generation) and instruments it; `lean` installs infer-tune's own
loop as the target's `generate` for the duration of the config. `cleanup` undoes either.
"""

from __future__ import annotations

from typing import Any

from infer_tune import models
from infer_tune.document import ResultDocument
from infer_tune.errors import ConfigError
from infer_tune.nn_utils import shallow_clone
from infer_tune.runners.generation import eos_ids
from infer_tune.runners.prepared import PreparedModel
from infer_tune.tuners.base import RunContext
from infer_tune.tuners.speculate import drafts, hf, lean
from infer_tune.tuners.speculate.config import (
    EARLY_EXIT,
    HF_ENGINE,
    PROMPT_LOOKUP,
    SELF_DRAFT,
    SpeculateConfig,
)
from infer_tune.tuners.speculate.counters import SpeculativeCounters

WARNINGS_KEY = "speculate.warnings"
PROMPT_IDS_KEY = "speculate.prompt_ids"  # the scenario puts the measured prompt ids here (training overlap)


def _self_draft(loaded: models.LoadedModel, layers: int, ctx: RunContext):
    cache = ctx.cache.setdefault("speculate.self_drafts", {})
    if layers not in cache:
        cache[layers] = drafts.self_draft(loaded.model, layers, share=True)
    return cache[layers]


def _warn(ctx: RunContext, message: str) -> None:
    warnings = ctx.cache.setdefault(WARNINGS_KEY, [])
    if message not in warnings:
        warnings.append(message)


def draft_facts(loaded: models.LoadedModel, config: SpeculateConfig, ctx: RunContext) -> dict[str, Any]:
    """Check the draft source against the target and return what is known of it before measuring.

    Raises ConfigError when the pair cannot run (another tokenizer without a universal path, a
    self-draft as deep as the target, early exit on a model that ignores it); warns when a draft
    model is not smaller than the target.
    """
    source = config.source
    target_params = models.count_params(loaded.model)
    facts: dict[str, Any] = {"draft_kind": source.kind, "engine": config.engine, "draft_tokenizer": None,
                             "draft_params": 0, "draft_layers": source.layers, "target_params": target_params,
                             "batch_size_note": "speculative decoding runs one request at a time (batch size 1)"}
    if source.kind == "model":
        draft = drafts.load_draft(ctx, source.ref)
        facts["draft_tokenizer"] = drafts.tokenizer_relation(loaded, draft, engine=config.engine)
        facts["draft_params"] = models.count_params(draft.model)
        facts["draft_path"] = draft.path
        if config.draft_vocab:
            draft_vocabulary(dict(facts), config.draft_vocab)  # refuses a draft without token counts, up front
        if facts["draft_params"] >= target_params:
            _warn(ctx, f"draft '{source.ref}' has {facts['draft_params']:,} parameters, not fewer than the "
                       f"target's {target_params:,}: it cannot be cheaper per step than the target itself")
        manifest = drafts.distill_manifest(draft.path)
        if manifest is not None:
            facts.update(_training_overlap(manifest, ctx))
    elif source.kind in (SELF_DRAFT, EARLY_EXIT):
        total = drafts.num_layers(loaded.model)
        if source.layers >= total:
            raise ConfigError(f"speculate draft '{config.draft}': {source.layers} layers is not fewer than the "
                              f"target's {total}; choose 1..{total - 1}")
        if source.kind == EARLY_EXIT and config.engine == HF_ENGINE \
                and not drafts.early_exit_supported(loaded.model, source.layers):
            raise ConfigError(f"speculate draft '{config.draft}': {type(loaded.model).__name__} ignores a lowered "
                              "num_hidden_layers, so transformers' assistant_early_exit would run every layer; "
                              f"use self-draft:{source.layers} instead")
        facts["draft_params"] = models.count_params(_self_draft(loaded, source.layers, ctx))
        facts["draft_tokenizer"] = "same"
    facts["draft_target_param_ratio"] = facts["draft_params"] / target_params
    return facts


def task_key(prompt_id: str) -> str:
    """The task a prompt comes from: `code-edit`'s `HumanEval/7/rename` is HumanEval/7 of `code`."""
    parts = str(prompt_id).split("/")
    return "/".join(parts[:2]) if parts[0] == "HumanEval" else str(prompt_id)


def _training_overlap(manifest: dict, ctx: RunContext) -> dict[str, Any]:
    """How many measured prompts (or their HumanEval tasks) the distilled draft was trained on."""
    trained = {task_key(p) for p in manifest.get("train_prompt_ids", [])}
    measured = ctx.cache.get(PROMPT_IDS_KEY) or []
    overlap = sorted(p for p in measured if task_key(p) in trained)
    if overlap:
        _warn(ctx, f"{len(overlap)} of the {len(measured)} measured prompts were in the draft's distillation "
                   "data: its acceptance there is not what unseen prompts get")
    return {"draft_distilled": True, "draft_train_prompts": len(trained), "draft_train_overlap": len(overlap)}


def draft_vocabulary(facts: dict[str, Any], size: int) -> list[int]:
    """The `size` tokens the target emitted most in the draft's distillation data (its manifest)."""
    manifest = drafts.distill_manifest(facts.get("draft_path") or "") or {}
    counts = manifest.get("output_token_counts")
    if not counts:
        raise ConfigError("speculate draft_vocab needs a draft made by `speculate distill` (its manifest records "
                          "which tokens the target emits); this draft has none")
    ranked = sorted(counts.items(), key=lambda item: -item[1])[:size]
    facts["draft_vocab_kept"] = len(ranked)
    facts["draft_vocab_coverage"] = sum(n for _, n in ranked) / sum(counts.values())
    return [int(token) for token, _ in ranked]


def preflight(loaded: models.LoadedModel, config: SpeculateConfig, ctx: RunContext) -> None:
    """Every check that needs the model, before anything of the sweep is measured."""
    draft_facts(loaded, config, ctx)


def prepare(loaded: models.LoadedModel, config: SpeculateConfig, ctx: RunContext) -> PreparedModel:
    """The target with its draft source wired in (hf: generate kwargs; lean: the own loop), counted."""
    source = config.source
    facts = draft_facts(loaded, config, ctx)
    # the engine measures the plain model beside this config in the same rounds: instrument a clone of its
    # top-level module (same weights), never the model itself
    target = shallow_clone(loaded.model)
    counters = SpeculativeCounters()
    kwargs: dict[str, Any] = {}
    undo: list = []
    draft_model = None
    extra_bytes = 0
    scorer = None  # the row's own perplexity scorer (a native verifier on the int8 KV cache)
    if source.kind == "model":
        draft = drafts.load_draft(ctx, source.ref)
        draft_model = draft.model
        extra_bytes = models.model_bytes(draft_model)
        if facts["draft_tokenizer"] == "universal":
            kwargs.update(tokenizer=loaded.tokenizer, assistant_tokenizer=draft.tokenizer)
    elif source.kind == SELF_DRAFT:
        draft_model = _self_draft(loaded, source.layers, ctx)
        extra_bytes = drafts.unshared_bytes(draft_model, target)
    if config.engine == HF_ENGINE:
        if source.kind == PROMPT_LOOKUP:
            kwargs.update(prompt_lookup_num_tokens=config.num_draft_tokens,
                          max_matching_ngram_size=config.max_matching_ngram_size)
        elif source.kind == EARLY_EXIT:
            kwargs["assistant_early_exit"] = source.layers
            undo.append(hf.configure_assistant(target, config.num_draft_tokens))
        else:
            kwargs["assistant_model"] = draft_model
            undo.append(hf.configure_assistant(draft_model, config.num_draft_tokens))
        undo.append(hf.instrument(target, counters, draft=draft_model, device=ctx.device))
    else:
        eos = eos_ids(target, loaded.tokenizer)
        if source.kind == PROMPT_LOOKUP:
            drafter = lean.LookupDrafter(config.max_matching_ngram_size, eos)
        else:
            vocab = draft_vocabulary(facts, config.draft_vocab) if config.draft_vocab else None
            drafter = lean.ModelDrafter(draft_model, counters, ctx.device, vocab=vocab, eos_ids=eos)
        verifier = None
        if config.native_step:
            from infer_tune.native.step import recognize
            from infer_tune.tuners.kv_cache import native_kv_dtype

            parts, why = recognize(target)
            kv_dtype = native_kv_dtype(ctx)
            if parts is None and kv_dtype != "fp32":
                raise ConfigError(f"the native step's {kv_dtype} KV cache: the native step does not run this model "
                                  f"({why})")
            if parts is None:
                facts["speculate_native_fallback"] = why
            else:
                verifier = lean.NativeVerifier(target, parts, kv_dtype, facts)
                facts["kv_dtype"] = kv_dtype
                if kv_dtype != "fp32":  # the row's ppl from what decodes: the native step on the int8 cache
                    import functools

                    from infer_tune.native.perplexity import native_rows_nll

                    scorer = functools.partial(native_rows_nll, target, parts, kv_dtype=kv_dtype)
            facts["speculate_verify"] = "native" if verifier is not None else "torch"
        target.generate = lean.speculative_generate(target, drafter, config.num_draft_tokens, counters, ctx.device,
                                                    verifier=verifier)
        undo.append(lambda: target.__dict__.pop("generate", None))

    def cleanup() -> None:
        for fn in reversed(undo):
            fn()

    return PreparedModel(model=target, tokenizer=loaded.tokenizer, generate_kwargs=kwargs, metrics=facts,
                         label=config.label(), device=ctx.device, counters=counters, extra_model_bytes=extra_bytes,
                         cleanup=cleanup, scorer=scorer)


def annotate(doc: ResultDocument, earlier: list[dict]) -> None:
    """Losslessness: greedy speculative decoding must reproduce the target-alone outputs token for token."""
    mismatches = doc.metrics.get("output_mismatches")
    doc.add_metrics({"lossless": mismatches == 0 if mismatches is not None else None}, source="speculate's finish")
