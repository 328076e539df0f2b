"""The expert load file: tokens per expert per MoE layer, co-activation and routed expert sets (JSON).

Written by `experts profile`, read by the planners. Per MoE layer it holds:
- `counts[e]`: how many tokens chose expert e (each token counts once per expert of its top-k);
- `coactivation[i][j]`: how many tokens chose both i and j (symmetric, zero diagonal);
- `routes`: the distinct expert sets chosen by one token, with how many tokens chose each
  (`[[sorted expert ids], count]`), kept for the first `route_tokens` tokens of each layer; the
  planners' communication metrics are exact expectations over these sets.
The model block records what the planners need without loading the model: hidden size, activation
bytes, bytes of one expert in one layer and of the dense (non-expert) weights.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from infer_tune import atomic, jsonsafe
from infer_tune.errors import ConfigError

KIND = "infer-tune-expert-load"
VERSION = 1


@dataclass
class LayerLoad:
    """Routing statistics of one MoE layer."""

    name: str
    counts: np.ndarray  # [E] int64
    coactivation: np.ndarray  # [E, E] int64, symmetric, zero diagonal
    routes: list[tuple[tuple[int, ...], int]] = field(default_factory=list)

    @property
    def tokens(self) -> int:
        """Tokens routed through this layer (each token picked top_k experts)."""
        return int(sum(c for _, c in self.routes)) if self.routes else 0


@dataclass
class ModelInfo:
    """What planning needs to know about the model."""

    ref: str
    path: str
    model_type: str
    num_experts: int
    top_k: int
    hidden_size: int
    dtype_bytes: int
    expert_bytes: int  # one expert of one layer
    dense_bytes: int  # everything that is not a routed expert (replicated on every device)
    num_groups: int = 1  # expert groups of group-limited routing (DeepSeek-V3 n_group), else 1
    dtype: str = ""  # the experts' dtype name

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass
class LoadFile:
    """A profile of one model's routing on one workload."""

    model: ModelInfo
    layers: list[LayerLoad]
    workload: dict[str, Any] = field(default_factory=dict)
    tokens: int = 0  # tokens profiled (per layer)
    route_tokens: int = 0  # tokens whose expert sets are kept in `routes` (per layer)

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def loads(self) -> np.ndarray:
        """[L, E] tokens per expert per layer."""
        return np.stack([layer.counts for layer in self.layers]).astype(np.float64)

    def to_dict(self) -> dict[str, Any]:
        return {
            "kind": KIND, "version": VERSION, "model": self.model.to_dict(), "workload": self.workload,
            "tokens": self.tokens, "route_tokens": self.route_tokens,
            "layers": [{"name": layer.name, "counts": layer.counts.tolist(),
                        "coactivation": layer.coactivation.tolist(),
                        "routes": [[list(s), int(c)] for s, c in layer.routes]} for layer in self.layers],
        }

    def save(self, path: Path) -> Path:
        atomic.write_json(Path(path), self.to_dict())
        return Path(path)


def _fail(source: str, what: str) -> ConfigError:
    return ConfigError(f"load file {source} is malformed: {what}")


def _int_list(value: Any, n: int, source: str, what: str) -> np.ndarray:
    if not isinstance(value, list) or len(value) != n or not all(
            isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value):
        raise _fail(source, f"{what} must be a list of {n} non-negative integers")
    return np.asarray(value, dtype=np.int64)


def from_dict(doc: Any, source: str = "<dict>") -> LoadFile:
    """Parse and check a load-file document; every problem is a ConfigError naming the field."""
    if not isinstance(doc, dict) or doc.get("kind") != KIND:
        raise _fail(source, f"not an expert load file (expected \"kind\": \"{KIND}\"; "
                            "write one with `infer-tune experts profile`)")
    if doc.get("version") != VERSION:
        raise _fail(source, f"version {doc.get('version')!r}; this infer-tune reads version {VERSION}")
    raw = doc.get("model")
    if not isinstance(raw, dict):
        raise _fail(source, "`model` must be an object")
    fields = {"ref": str, "path": str, "model_type": str, "num_experts": int, "top_k": int, "hidden_size": int,
              "dtype_bytes": int, "expert_bytes": int, "dense_bytes": int}
    values: dict[str, Any] = {}
    for name, kind in fields.items():
        value = raw.get(name)
        if not isinstance(value, kind) or isinstance(value, bool):
            raise _fail(source, f"model.{name} must be a{'n integer' if kind is int else ' string'}")
        values[name] = value
    values["num_groups"] = raw.get("num_groups", 1)
    values["dtype"] = str(raw.get("dtype", ""))
    for name in ("num_experts", "top_k", "hidden_size", "dtype_bytes", "num_groups"):
        if not isinstance(values[name], int) or values[name] < 1:
            raise _fail(source, f"model.{name} must be an integer >= 1")
    info = ModelInfo(**values)
    if info.top_k > info.num_experts:
        raise _fail(source, f"model.top_k {info.top_k} exceeds model.num_experts {info.num_experts}")
    n = info.num_experts
    raw_layers = doc.get("layers")
    if not isinstance(raw_layers, list) or not raw_layers:
        raise _fail(source, "`layers` must be a non-empty list")
    layers = []
    for i, entry in enumerate(raw_layers):
        if not isinstance(entry, dict):
            raise _fail(source, f"layers[{i}] must be an object")
        counts = _int_list(entry.get("counts"), n, source, f"layers[{i}].counts")
        co = entry.get("coactivation")
        if not isinstance(co, list) or len(co) != n:
            raise _fail(source, f"layers[{i}].coactivation must be a {n}x{n} matrix")
        matrix = np.stack([_int_list(row, n, source, f"layers[{i}].coactivation row") for row in co])
        if not np.array_equal(matrix, matrix.T) or np.any(np.diag(matrix)):
            raise _fail(source, f"layers[{i}].coactivation must be symmetric with a zero diagonal")
        routes = []
        for route in entry.get("routes") or []:
            if (not isinstance(route, list) or len(route) != 2 or not isinstance(route[0], list)
                    or not isinstance(route[1], int) or route[1] < 1):
                raise _fail(source, f"layers[{i}].routes entries must be [[expert ids], count >= 1]")
            experts = tuple(int(e) for e in route[0])
            if not experts or len(experts) > info.top_k or any(not 0 <= e < n for e in experts) \
                    or len(set(experts)) != len(experts):
                raise _fail(source, f"layers[{i}].routes holds an expert set {route[0]} outside 0..{n - 1} "
                                    f"or larger than top_k {info.top_k}")
            routes.append((tuple(sorted(experts)), route[1]))
        layers.append(LayerLoad(name=str(entry.get("name", f"layer{i}")), counts=counts, coactivation=matrix,
                                routes=routes))
    if all(int(layer.counts.sum()) == 0 for layer in layers):
        raise _fail(source, "every layer has zero routed tokens")
    tokens, route_tokens = doc.get("tokens", 0), doc.get("route_tokens", 0)
    if not isinstance(tokens, int) or not isinstance(route_tokens, int):
        raise _fail(source, "tokens and route_tokens must be integers")
    workload = doc.get("workload") if isinstance(doc.get("workload"), dict) else {}
    return LoadFile(model=info, layers=layers, workload=workload, tokens=tokens, route_tokens=route_tokens)


def load(path: str | Path) -> LoadFile:
    """Read a load file; missing, unreadable or malformed files raise ConfigError."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"load file not found: {path} (write one with `infer-tune experts profile`)")
    try:
        doc = jsonsafe.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConfigError(f"load file {path} is malformed: not valid JSON ({exc})") from None
    return from_dict(doc, str(path))
