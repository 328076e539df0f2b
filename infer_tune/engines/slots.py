"""The `slots` engine: the serving engine with the native step that `serve` runs (tuners/batch/slots.py's
SlotEngine fed live by tuners/batch/serving.py's LiveSlots; endpoint/serving.py is its HTTP server).

How a technique stack maps onto its settings (`settings(stack)`, what scenarios/serve.py builds): a `quantize`
part is applied to the weights (bf16 adds nothing); a `batch` part (engine `lean`, or `transformers`, whose
batch size the slot engine takes over) sets `slots`, `native_step`, `compile_prefill` and `every_bucket`; a
`lean` part is the single-stream lean path: one slot unless `slots` says more, its `compile` and
`native_step`; a `kv-cache` part with impl `static` or `dynamic` adds nothing (each slot's cache is static), one
with the native backend (`quantized`, `kv_backend: native`) sets `kv_dtype: int8` (the native step's int8 cache);
a `speculate` part with the prompt-lookup draft sets `speculate` (its draft tokens K) and `ngram`, verified in the
native step (the slots' speculation runs there only: tuners/batch/serving.py).
Anything else is refused with the reason (`supports`): the server runs only what it runs exactly.
"""

from __future__ import annotations

from infer_tune.engines import base
from infer_tune.engines.base import Engine, parts_of, register_engine
from infer_tune.engines.inprocess import _own_version
from infer_tune.metrics.schema import LEAN_LOOP_KEYS, SLOT_ENGINE_KEYS


def _check(part) -> str | None:
    if part.technique == "kv-cache" and part.impl not in ("static", "dynamic") and part.kv_backend != "native":
        return (f"serve: kv-cache impl '{part.impl}' ({part.label()}) is not served (each slot's cache is static: "
                "fp32, or int8 with kv_backend native)")
    if part.technique == "batch" and part.scheduler == "sweep":
        return "serve: a batch-size sweep row is not a serving configuration"
    if part.technique == "speculate" and part.source.kind != "prompt-lookup":
        return (f"serve: speculative draft '{part.draft}' is not served (the slots draft by prompt lookup, "
                "verified in the native step)")
    return None


def settings(stack) -> dict:
    """The slot engine's settings for a stack it supports (check `SLOTS.supports(stack)` first): `weights`
    (the weight configs applied in order), `slots`, `compile`, `compile_prefill`, `every_bucket`,
    `native_step`, and `notes` on what is served differently from how the stack was measured."""
    parts = parts_of(stack)
    out = {"weights": [], "slots": 1 if any(p.technique == "lean" for p in parts) else 4, "compile": True,
           "compile_prefill": False, "every_bucket": True, "native_step": False, "speculate": 0, "ngram": 2,
           "kv_dtype": "fp32", "notes": []}
    for part in parts:
        name = part.technique
        if name == "quantize" and part.method != "bf16":
            out["weights"].append(part)
        elif name == "kv-cache" and part.kv_backend == "native":
            out["kv_dtype"], out["native_step"], out["compile"] = "int8", True, False
        elif name == "lean":
            out["compile"], out["native_step"] = part.compile, part.native_step
            out["compile_prefill"] = part.compile and part.compile_prefill
        elif name == "speculate":
            out["speculate"], out["ngram"] = part.num_draft_tokens, part.max_matching_ngram_size
            out["native_step"], out["compile"] = True, False
            if not part.native_step:
                out["notes"].append(f"speculate {part.label()}: verified in the native step (measured "
                                    f"with engine '{part.engine}')")
        elif name == "batch":
            out["slots"] = part.batch_size
            if part.engine == "lean":
                out["native_step"], out["compile_prefill"] = part.native_step, part.compile_prefill
                out["every_bucket"] = part.step_buckets == "all"
                if part.speculate:
                    out["speculate"], out["ngram"] = part.speculate, part.ngram
            else:
                out["notes"].append(f"batch engine '{part.engine}': served by the slot engine at batch size "
                                    f"{part.batch_size}")
            if part.scheduler == "static":
                out["notes"].append("scheduler 'static': served continuously (requests join free slots at once)")
    return out


_NOT_SERVED = "is not served: the server runs only what it runs exactly"
SLOTS = register_engine(Engine(
    name=base.SLOTS, starts="in-process", runner="trace", selectable=False,
    description="the slot engine `serve` runs: one compiled or native step over every decoding slot",
    techniques={
        "quantize": "the weights quantized before the slots are built (bf16: as loaded)",
        "batch": "batch_size -> slots; engine lean: native_step, compile_prefill, step_buckets, speculate, ngram",
        "lean": "compile, native_step, compile_prefill (one slot unless a batch part says more)",
        "kv-cache": "impl static or dynamic: each slot's static cache (fp32); quantized with kv_backend native: "
                    "kv_dtype int8 (the native step's int8 cache)",
        "speculate": "draft prompt-lookup: num_draft_tokens -> speculate, max_matching_ngram_size -> ngram "
                     "(verified in the native step)",
    },
    unsupported={"experts": f"expert placement {_NOT_SERVED}",
                 "llama-cpp": f"llama.cpp {_NOT_SERVED}"},
    check=_check, settings=settings, version=_own_version, metric_keys={**SLOT_ENGINE_KEYS, **LEAN_LOOP_KEYS},
))
