"""The `remote` engine: any OpenAI-compatible endpoint already running (`bench --endpoint URL`), driven by the
endpoint runner. What it runs is the server's business: no technique of infer-tune maps onto it, so a stack
other than the baseline's is refused with the reason."""

from __future__ import annotations

from infer_tune.engines.base import Engine, register_engine
from infer_tune.metrics.schema import ENDPOINT_CLIENT_KEYS

REMOTE = register_engine(Engine(
    name="remote", starts="server", runner="endpoint", selectable=False,
    description="an OpenAI-compatible server measured as it is (bench --endpoint)",
    techniques={},
    unsupported={name: "the server runs what it was started with; measure it as it is (bench --endpoint)"
                 for name in ("quantize", "kv-cache", "speculate", "batch", "lean", "experts", "llama-cpp")},
    metric_keys=ENDPOINT_CLIENT_KEYS,
))
