"""`--executor` and `--ray-address` (bench --recipe, tune): where configs are measured (docs/scale.md)."""

from __future__ import annotations

from typing import Annotated

import typer

Executor = Annotated[str, typer.Option("--executor", help="Where configs are measured: local (here, one after another) "
                                                          "or ray (each config with its node's baseline as a Ray "
                                                          "task; pip install 'infer-tune[ray]').")]
RayAddress = Annotated[str | None, typer.Option("--ray-address", help="Ray cluster to join (HOST:PORT or ray://...; "
                                                                      "default: the local cluster, RAY_ADDRESS).")]


def scope(executor: str, ray_address: str | None, device: str):
    """A context in which scenarios hand their configs to the chosen executor (local: nothing changes)."""
    from infer_tune import executors

    return executors.use(executors.make(executor, ray_address, device=device))
