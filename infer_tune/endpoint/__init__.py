"""Benchmarking a live OpenAI-compatible server (vLLM, SGLang, TGI, llama.cpp, `transformers serve`).

- `config.EndpointConfig`: the endpoint, served model, API flavour and client limits (the API key
  only ever as the name of an environment variable).
- `client`: one streaming request, every server-sent event timestamped on arrival.
- `probe.connect`: reach the endpoint, record what it says about itself, settle the request form.
- `replay.replay_trace`: the library entry: a list of `TraceRequest` replayed open loop (or closed
  loop) with bounded concurrency -> per-request `RequestTiming`s, outputs, failures.
- `arrivals`: seeded Poisson / gamma traces; `servers`: reference engines started on loopback;
  `loopback`: an instant server, the yardstick of the client's own overhead (and of fault handling).

The `endpoint` runner (infer_tune.runners.endpoint) and scenario (infer_tune.scenarios.endpoint)
turn these into result documents. docs/endpoint.md.
"""

from infer_tune.endpoint.config import EndpointConfig
from infer_tune.endpoint.probe import EndpointError, connect
from infer_tune.endpoint.replay import Failure, ReplayResult, replay_trace

__all__ = ["EndpointConfig", "EndpointError", "Failure", "ReplayResult", "connect", "replay_trace"]
