"""Execute a workload against a prepared model and time every generated token."""

from infer_tune.runners.generation import GenerationRun, Protocol, RequestTiming, measure_generation

__all__ = ["GenerationRun", "Protocol", "RequestTiming", "measure_generation"]
