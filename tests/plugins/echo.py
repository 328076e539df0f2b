"""A technique that lives in its own package: the plain model under another name, with its own fact, claim
and `tune` candidate. `register()` adds it to the registry; `unregister()` takes it out again."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from infer_tune.runners.prepared import PreparedModel
from infer_tune.tuners.base import (
    Conclusion,
    Offer,
    TechniqueConfig,
    Tuning,
    register_technique,
    unregister_technique,
)

STATEMENT = "an echo decodes exactly like its source"


@dataclass
class EchoConfig(TechniqueConfig):
    technique: ClassVar[str] = "test-echo"
    tag: str = "a"


def prepare(loaded, config: EchoConfig, ctx) -> PreparedModel:
    return PreparedModel(loaded.model, loaded.tokenizer, label=f"echo-{config.tag}", metrics={"echo_tag": config.tag})


def conclude(docs: list, skipped: list) -> Conclusion:
    same = all(d["metrics"].get("output_mismatches") == 0 for d in docs)
    return Conclusion(claim={"statement": STATEMENT, "finding": f"{len(docs)} echo row(s), outputs identical: {same}",
                             "held": same})


def register() -> None:
    register_technique(EchoConfig, conclude=conclude, phase=2, metric_keys={"echo_tag": "the config's tag"},
                       tune=Tuning(offer=lambda ask: [] if ask.on is not None else
                                   [Offer(EchoConfig(tag="tuned"), lossless=True)]))(prepare)


def unregister() -> None:
    unregister_technique(EchoConfig)
