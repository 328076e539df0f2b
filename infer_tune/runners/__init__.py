"""Runners execute a workload against a prepared model and time every generated token.

One registry (`RUNNERS`, filled by `@register_runner`): `generation` (closed loop over fixed
batches), `speculative` (multi-token steps, batch size 1), `trace` (open-loop arrival trace through
a scheduler), `multiprocess` (a worker on N torch.distributed ranks) and `endpoint` (an
OpenAI-compatible server over HTTP, docs/endpoint.md). See docs/architecture.md.
"""

from infer_tune.runners import endpoint, generation, multiprocess, trace  # noqa: F401  (register the runners)
from infer_tune.runners.base import (
    RUNNERS,
    GenerationRun,
    Output,
    Protocol,
    RequestTiming,
    TokenClock,
    register_runner,
)
from infer_tune.runners.generation import measure_generation
from infer_tune.runners.prepared import PreparedModel, RunCounters


def get_runner(name: str):
    """The runner registered under `name` (the built-in ones are imported with this package; a technique's
    own runner registers when the technique registry imports its folder)."""
    from infer_tune.errors import ConfigError

    try:
        return RUNNERS[name]
    except KeyError:
        raise ConfigError(f"no runner named '{name}'; known: {', '.join(sorted(RUNNERS))}") from None


__all__ = ["RUNNERS", "GenerationRun", "Output", "PreparedModel", "Protocol", "RequestTiming", "RunCounters",
           "TokenClock", "get_runner", "measure_generation", "register_runner"]
