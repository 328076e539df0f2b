"""The lean path's compiled prefill (infer_tune/tuners/lean/prefill.py): prompts padded to a length bucket
and prefilled by a compiled graph decode to the same greedy tokens as the eager prefill, on tiny random
models of several architectures; a sliding-window model keeps the eager prefill."""

from __future__ import annotations

import pytest
import torch

from infer_tune.tuners.lean.prefill import MAX_BUCKET, prefill_bucket
from tests.test_quantize_families import tiny


@pytest.fixture(scope="module")
def tokenizer():
    from tests.conftest import build_tiny_tokenizer

    return build_tiny_tokenizer()


def test_buckets_cover_every_length_once():
    assert [prefill_bucket(n) for n in (1, 16, 17, 20, 33, 64, 65, 128, 129, 500, 512, 513)] == \
        [16, 16, 32, 32, 64, 64, 128, 128, 256, 512, 512, 640]
    assert prefill_bucket(MAX_BUCKET) == MAX_BUCKET and prefill_bucket(MAX_BUCKET + 1) is None
    assert all(prefill_bucket(n) >= n for n in range(1, MAX_BUCKET + 1))


def _decode(model, ids, *, compile_prefill: bool, tokens: int = 16):
    from infer_tune.tuners.lean.loop import LeanDecoder

    # decode step eager in both: only the prefill differs
    decoder = LeanDecoder(model, compile=False, compile_prefill=compile_prefill)
    runs = [decoder.generate(row[None], tokens, [1])[2] for row in ids]
    return runs, decoder.facts


@pytest.mark.parametrize("arch", ["llama", "qwen3", "phi3"])
def test_compiled_prefill_decodes_like_the_eager_one(arch, tokenizer):
    model = tiny(arch, tokenizer)
    generator = torch.Generator().manual_seed(1)
    # llama: 7 and 20 tokens share no bucket (16, 32): two graphs; a second 20-token prompt reuses its bucket.
    # The other families (one graph each: a compile is ~10 s of the suite): 7, 11 and 11 tokens in bucket 16
    long = 20 if arch == "llama" else 11
    prompts = [torch.randint(3, len(tokenizer), (n,), generator=generator) for n in (7, long, long)]
    eager, eager_facts = zip(*[_decode(model, [p], compile_prefill=False) for p in prompts])
    compiled, facts = _decode(model, prompts, compile_prefill=True)
    assert compiled == [e[0] for e in eager]
    assert facts["lean_prefill"] == "compiled", facts
    assert facts["lean_prefill_buckets"] == ([16, 32] if arch == "llama" else [16]), facts
    assert eager_facts[0]["lean_prefill"] == "eager"


def test_padding_never_reaches_the_decode(tokenizer):
    """The decode cache writes next at the prompt's length: were it left at the bucket's (the padding
    counted as context), the next tokens would differ."""
    from infer_tune.tuners.lean.prefill import CompiledPrefill

    model = tiny("llama", tokenizer)
    ids = torch.randint(3, len(tokenizer), (1, 9), generator=torch.Generator().manual_seed(2))
    reference, _ = _decode(model, ids, compile_prefill=False)
    transfer = CompiledPrefill._transfer
    try:
        def at_bucket(src, dst, length):
            transfer(src, dst, length)
            for layer in dst.layers:
                layer.cumulative_length.fill_(16)
        CompiledPrefill._transfer = staticmethod(at_bucket)
        wrong, _ = _decode(model, ids, compile_prefill=True)
    finally:
        CompiledPrefill._transfer = staticmethod(transfer)
    right, _ = _decode(model, ids, compile_prefill=True)
    assert right == reference and wrong != reference


def test_sliding_window_model_prefills_eagerly(tokenizer):
    model = tiny("gemma3", tokenizer)
    ids = torch.randint(3, len(tokenizer), (1, 12), generator=torch.Generator().manual_seed(3))
    reference, _ = _decode(model, ids, compile_prefill=False)
    out, facts = _decode(model, ids, compile_prefill=True)
    assert out == reference and facts["lean_prefill"] == "eager" and "lean_prefill_buckets" not in facts
