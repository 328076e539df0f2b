"""Quality of generated text: BLEU/chrF against references, drift and faithfulness to the baseline."""

from __future__ import annotations

from collections.abc import Sequence

import sacrebleu

from infer_tune.suites import detect_lang


def bleu_tokenizer(texts: Sequence[str]) -> str:
    """sacrebleu tokenizer for these texts: `zh` when they are mostly Chinese, else the default `13a`."""
    sample = " ".join(t for t in texts[:50] if t)
    return "zh" if detect_lang(sample) == "zh" else "13a"


def reference_scores(hypotheses: Sequence[str], references: Sequence[str | None]) -> dict[str, float | str | None]:
    """Corpus BLEU and chrF of `hypotheses` against the references that exist (None when there are none)."""
    pairs = [(h, r) for h, r in zip(hypotheses, references) if r is not None]
    if not pairs:
        return {"bleu": None, "chrf": None, "bleu_tokenizer": None}
    hyps, refs = [h for h, _ in pairs], [r for _, r in pairs]
    tokenize = bleu_tokenizer(refs)
    bleu = sacrebleu.corpus_bleu(hyps, [refs], tokenize=tokenize)
    chrf = sacrebleu.corpus_chrf(hyps, [refs])
    return {"bleu": float(bleu.score), "chrf": float(chrf.score), "bleu_tokenizer": tokenize}


def bleu_drift_interval(cand: Sequence[str], base: Sequence[str], references: Sequence[str | None], *,
                        seed: int = 0, resamples: int = 200) -> list[float] | None:
    """95% paired bootstrap interval of BLEU(cand) - BLEU(base): prompts resampled with replacement,
    both corpora scored on the same resample. With few prompts it is wide, which is the point: a
    BLEU drift of a handful of short outputs says little on its own (read perplexity and faithfulness)."""
    import numpy as np

    idx = [i for i, r in enumerate(references) if r is not None]
    if len(idx) < 2 or len(cand) != len(base):
        return None
    tokenize = bleu_tokenizer([references[i] for i in idx])
    rng = np.random.default_rng(seed)
    drifts = []
    for _ in range(resamples):
        pick = [idx[k] for k in rng.integers(0, len(idx), size=len(idx))]
        refs = [[references[i] for i in pick]]
        drifts.append(sacrebleu.corpus_bleu([cand[i] for i in pick], refs, tokenize=tokenize).score
                      - sacrebleu.corpus_bleu([base[i] for i in pick], refs, tokenize=tokenize).score)
    return [float(np.percentile(drifts, 2.5)), float(np.percentile(drifts, 97.5))]


def first_divergence(a: Sequence[int], b: Sequence[int]) -> int | None:
    """Index of the first token where two sequences differ (None when identical)."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def faithfulness(
    cand_texts: Sequence[str], base_texts: Sequence[str], cand_ids: Sequence[Sequence[int]],
    base_ids: Sequence[Sequence[int]],
) -> dict[str, float | int | None]:
    """How closely a candidate reproduces the baseline's own outputs on the same prompts.

    `bleu_vs_baseline`: corpus BLEU with the baseline outputs as references; `exact_match_vs_baseline`:
    share of identical token sequences; `first_divergence_token`: mean index of the first differing
    token over the outputs that differ (None when all match); `output_mismatches`: count that differ.
    """
    if len(cand_ids) != len(base_ids):
        raise ValueError(f"faithfulness needs the same prompts: {len(cand_ids)} vs {len(base_ids)} outputs")
    divergences = [first_divergence(c, b) for c, b in zip(cand_ids, base_ids)]
    differing = [d for d in divergences if d is not None]
    tokenize = bleu_tokenizer(list(base_texts))
    bleu = sacrebleu.corpus_bleu(list(cand_texts), [list(base_texts)], tokenize=tokenize).score if cand_texts else None
    n = len(divergences)
    return {
        "bleu_vs_baseline": None if bleu is None else float(bleu),
        "exact_match_vs_baseline": (n - len(differing)) / n if n else None,
        "first_divergence_token": sum(differing) / len(differing) if differing else None,
        "output_mismatches": len(differing),
    }
