"""The engines that run in this Python process: `torch` (eager transformers: `generate`, the batch scheduler's
padded forwards) and `lean` (infer-tune's compiled decode loop, with the native C++ step where step.py
recognizes the model: tuners/lean, native/step.py). Registered on import (engines/base.py).

The torch engine is also started as a reference server (`endpoint reference --engine transformers`):
`transformers serve` on the model's checkpoint directory (offline), with or without its continuous batching."""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Sequence

from infer_tune.engines import base
from infer_tune.engines.base import Engine, ServeHere, register_engine
from infer_tune.errors import ConfigError
from infer_tune.metrics.schema import LEAN_LOOP_KEYS

TRANSFORMERS_SERVE_MODULES = ("fastapi", "uvicorn", "openai", "pydantic")


def _torch_version() -> dict:
    import torch
    import transformers

    return {"torch": torch.__version__, "transformers": transformers.__version__}


def _own_version() -> dict:
    """The lean loop and the slot engine are infer-tune's own code: its version and commit, on torch."""
    import torch

    from infer_tune import env

    tool = env.tool_info()
    return {"version": tool["version"], "commit": tool["git_revision"], "torch": torch.__version__}


def _lean_check(part) -> str | None:
    if part.technique == "kv-cache" and getattr(part, "impl", "static") not in ("static", "dynamic"):
        return f"engine lean keeps its own static cache: kv-cache impl '{part.impl}' is not run by it"
    return None


def _serve_command(model_ref: str, port: int, *, continuous_batching: bool = False, threads: int | None = None,
                   context_tokens: int = 2048, parallel: int = 1, extra_args: Sequence[str] = ()) -> tuple[list[str], str]:
    """`transformers serve` of the model's checkpoint on 127.0.0.1:port (threads: OMP_NUM_THREADS, set by the caller)."""
    from infer_tune import models

    checkpoint = models.resolve(model_ref)
    cmd = [sys.executable, "-c", "from transformers.cli.transformers import main; main()", "serve", checkpoint,
           "--host", "127.0.0.1", "--port", str(port), "--device", "cpu", "--log-level", "warning"]
    cmd.append("--continuous-batching" if continuous_batching else "--no-continuous-batching")
    return cmd + list(extra_args), checkpoint


def _serve_check(parallel: int) -> None:
    if parallel > 1:
        raise ConfigError("parallel slots are llama.cpp's server option; transformers serve batches with "
                          "--continuous-batching")


def _serve_missing() -> list[str]:
    return [m for m in TRANSFORMERS_SERVE_MODULES if importlib.util.find_spec(m) is None]


TORCH = register_engine(Engine(
    name=base.TORCH, starts="in-process", runner="generation", aliases=("hf", "transformers"),
    description="eager transformers: the model's own forward under `generate` (the baseline's engine)",
    techniques={
        "quantize": "the weights replaced in place (tuners/quantize: int8 / int4 / fp8 modules, bf16 casts)",
        "kv-cache": "the cache class `generate` is given (impl: dynamic, static, quantized, offloaded...)",
        "speculate": "assisted generation (speculate engine: hf)",
        "batch": "padded batches of the model's forward, scheduled by tuners/batch (batch engine: transformers)",
        "experts": "expert placement over devices (tuners/experts, the multiprocess runner)",
    },
    unsupported={"lean": "the compiled loop is the lean engine", "llama-cpp": "a GGUF runs on the llama.cpp engine"},
    version=_torch_version, spelling=base.SPELLING[base.TORCH],
    serve_here=ServeHere(command=_serve_command, check=_serve_check, missing=_serve_missing, extra="serve"),
))

LEAN = register_engine(Engine(
    name=base.LEAN, starts="in-process", runner="generation",
    description="infer-tune's compiled decode loop (static cache, captured or native C++ step)",
    techniques={
        "lean": "compile, native_step, prefill buckets (tuners/lean)",
        "quantize": "the quantized modules run inside the loop; the native step reads int4 / int8 weights",
        "kv-cache": "its own static cache (impl static or dynamic only)",
        "speculate": "drafts verified by the compiled loop (speculate engine: lean)",
        "batch": "slots of the compiled step (batch engine: lean; the slots engine)",
    },
    unsupported={"experts": "expert placement runs on the torch engine",
                 "llama-cpp": "a GGUF runs on the llama.cpp engine"},
    check=_lean_check, version=_own_version, metric_keys=LEAN_LOOP_KEYS,
))
