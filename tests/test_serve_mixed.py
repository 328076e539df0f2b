"""`infer-tune serve`'s engine on the native step (infer_tune/tuners/batch/serving.py, `_mixed_loop`): a new
request's prompt runs in the same native step as the decode rows of the requests already decoding, and every
request still gets the tokens the engine decodes for its prompt alone."""

from __future__ import annotations

import threading

import pytest
import torch

from tests.test_native_step import quantized, tiny_llama
from tests.test_native_step import tokenizer as tokenizer  # noqa: F401 (a fixture)

pytestmark = pytest.mark.usefixtures("native_kernels", "one_thread")


def test_prefill_rides_with_decode_rows_and_outputs_equal_alone(tokenizer):
    from infer_tune.tuners.batch.serving import LiveRequest, LiveSlots

    model = quantized(tiny_llama(tokenizer))
    engine = LiveSlots(model, [model.config.eos_token_id], slots=3, max_context=192, compile=False, native_step=True,
                       prefill_chunk=8)
    assert engine.engine.native
    gen = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, len(tokenizer), (n,), generator=gen).tolist() for n in (5, 19, 11, 30)]
    engine.warm(prompts[0])
    limits = [64, 24, 24, 24]  # the first request decodes through the others' prompts
    alone = [engine.alone(p, n, ignore_eos=True) for p, n in zip(prompts, limits)]

    outputs: list[list[int]] = [[] for _ in prompts]
    finished = [threading.Event() for _ in prompts]
    started = threading.Event()

    def emitter(i):
        def emit(token, finish):
            if token is not None:
                outputs[i].append(token)
                if i == 0 and len(outputs[0]) == 3:
                    started.set()
            if finish is not None:
                finished[i].set()
        return emit

    engine.start()
    try:
        engine.submit(LiveRequest(ids=prompts[0], max_tokens=limits[0], emit=emitter(0), ignore_eos=True))
        assert started.wait(60)  # the first request decodes; the others' prompts join its steps
        for i in range(1, len(prompts)):
            engine.submit(LiveRequest(ids=prompts[i], max_tokens=limits[i], emit=emitter(i), ignore_eos=True))
        for event in finished:
            assert event.wait(120)
    finally:
        engine.stop()
    assert engine.failure is None, engine.failure
    assert outputs == alone
    # steps that held decode rows and prompt rows together; a 30-token prompt over 8-token chunks took 4 steps
    assert engine.engine.facts["slot_mixed_steps"] >= 4, engine.engine.facts
