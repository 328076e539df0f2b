"""Ranks started by torchrun instead of spawned: the `multiprocess` runner across hosts.

`torchrun --nnodes N --nproc-per-node K --rdzv-backend c10d --rdzv-endpoint HOST:PORT -m infer_tune
experts validate ...` starts the same command N x K times with RANK, WORLD_SIZE, LOCAL_RANK (and
GROUP_RANK, LOCAL_WORLD_SIZE, TORCHELASTIC_RUN_ID, MASTER_ADDR / MASTER_PORT) in the environment.
Every process joins one process group through env:// (gloo on CPU; gloo for control and nccl for
CUDA tensors on GPUs). Rank 0 runs the command as usual (baseline, results, output); the others only
`follow`: each launch the runner makes is broadcast to them (the worker and setup functions by
reference, the payload), every rank runs its share through the runner's own rank body, and rank 0
gathers the readings. Rank 0 ends with a stop message and a barrier that every rank passes before
leaving the group. Followers write nothing.
See docs/experts.md ("Across hosts with torchrun") and docs/scale.md.
"""

from __future__ import annotations

import os
from datetime import timedelta

import torch

from infer_tune.errors import ConfigError, InferTuneError

TIMEOUT = timedelta(minutes=60)  # a follower waits this long for rank 0's next launch (the baseline runs first)


def detect() -> dict | None:
    """The launcher's view of this process, or None when not started by torchrun (or a compatible launcher)."""
    env = os.environ
    if not all(k in env for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK")):
        return None
    if "TORCHELASTIC_RUN_ID" not in env and "MASTER_ADDR" not in env:
        return None
    try:
        world = int(env["WORLD_SIZE"])
        info = {"rank": int(env["RANK"]), "world_size": world, "local_rank": int(env["LOCAL_RANK"]),
                "local_world_size": int(env.get("LOCAL_WORLD_SIZE", world)),
                "group_rank": int(env.get("GROUP_RANK", 0))}
    except ValueError as exc:
        raise ConfigError(f"the launcher's environment is malformed: {exc}") from None
    info["nnodes"] = max(1, world // max(info["local_world_size"], 1))
    info["run_id"] = env.get("TORCHELASTIC_RUN_ID")
    info["master"] = f"{env.get('MASTER_ADDR', '?')}:{env.get('MASTER_PORT', '?')}"
    return info


_STATE: dict = {}


def joined() -> bool:
    """Whether this process is rank 0 of a launcher's group (the runner then hands launches out)."""
    return bool(_STATE.get("info"))


def info() -> dict | None:
    return _STATE.get("info")


def _backend(device: str) -> str:
    return "cpu:gloo,cuda:nccl" if device.startswith("cuda") else "gloo"


def join(device: str = "cpu") -> dict:
    """Join the launcher's process group (env:// rendezvous); returns the launcher info."""
    import torch.distributed as dist

    found = detect()
    if found is None:
        raise ConfigError("not started by torchrun: RANK, WORLD_SIZE and LOCAL_RANK are not set")
    if device.startswith("cuda"):
        torch.cuda.set_device(found["local_rank"])
    if not dist.is_initialized():
        dist.init_process_group(_backend(device), init_method="env://", timeout=TIMEOUT)
    _STATE["info"] = found
    return found


def release() -> None:
    """Rank 0: tell the followers to stop, leave the group."""
    import torch.distributed as dist

    if not _STATE.pop("info", None) or not dist.is_initialized():
        return
    try:
        dist.broadcast_object_list([None], src=0)
        dist.barrier()  # every follower has the stop before anyone tears its connections down
    finally:
        dist.destroy_process_group()


def _guarded(run_rank, rank: int, world: int, job: dict) -> dict:
    try:
        return run_rank(rank, world, job["worker"], job["payload"], job["backend"], job["threads"], job["setup"])
    except Exception as exc:  # reported to rank 0, which raises it as the run's error
        return {"error": f"rank {rank}: {type(exc).__name__}: {exc}"}


def follow(run_rank, device: str = "cpu") -> int:
    """A rank other than 0: run every launch rank 0 hands out until it says stop; returns launches run."""
    import torch.distributed as dist

    found = join(device)
    _STATE.pop("info", None)  # not the driver
    launches = 0
    try:
        while True:
            box = [None]
            dist.broadcast_object_list(box, src=0)
            job = box[0]
            if job is None:
                # rank 0 waits here too: a group torn down while a peer still reads the stop message can leave
                # that peer's worker failed, and torchrun's agents then wait out their exit barrier
                dist.barrier()
                return launches
            reading = _guarded(run_rank, found["rank"], found["world_size"], job)
            dist.gather_object(reading, None, dst=0)
            launches += 1
    finally:
        dist.destroy_process_group()


def launch(run_rank, worker, payload, *, procs: int, backend: str, threads: int | None, setup=None) -> list[dict]:
    """Rank 0: one launch over the launcher's ranks (this process is rank 0); every rank's reading."""
    import torch.distributed as dist

    found = _STATE["info"]
    world = found["world_size"]
    if procs != world:
        raise ConfigError(f"the run needs {procs} processes but torchrun started {world} "
                          f"(--nnodes x --nproc-per-node must equal the plan's devices)")
    per_rank = max(1, (threads or torch.get_num_threads()) // max(found["local_world_size"], 1))
    job = {"worker": worker, "setup": setup, "payload": payload, "backend": backend, "threads": per_rank}
    dist.broadcast_object_list([job], src=0)
    saved = torch.get_num_threads()
    try:
        reading = _guarded(run_rank, 0, world, job)
    finally:
        torch.set_num_threads(saved)
    readings: list = [None] * world
    dist.gather_object(reading, readings, dst=0)
    errors = [r["error"] for r in readings if isinstance(r, dict) and "error" in r]
    if errors:
        raise InferTuneError(f"a rank of the torchrun job failed: {errors[0]}")
    for r in readings:
        r["launcher"] = "torchrun"
    return readings
