"""The multi-process launcher: a technique's worker run in N processes joined by torch.distributed.

A technique puts into `PreparedModel.runner_options`:
  `worker`  a module-level function `worker(rank, world_size, payload) -> dict` (it is pickled by
            reference into spawned processes, so it must be importable);
  `procs`   the number of processes (default 2);
  `payload` any picklable object every rank receives (a model path, a placement plan...);
  `backend` `gloo` (CPU, the default) or `nccl` (one GPU per rank);
  `setup`   (optional) a module-level `setup(rank, world_size, payload) -> state` run before the
            timed section (loading a model, say); the worker then receives `state` as its payload;
  `with_inputs` (optional, True) the payload (a dict) gets `inputs`: the workload's tokenized
            batches as lists (`batches`, each {input_ids, attention_mask}), `max_new_tokens` and
            `pin_length`, so workers can run the workload themselves.
Each rank starts with the process group initialised (loopback rendezvous on a free port) and its
torch threads set to threads // procs; the launcher times the worker between two barriers and reads
the rank's peak RSS (and CUDA peak) itself. What a worker returns under `counters` is summed over
ranks into the run's counters; the rest is kept per rank in `GenerationRun.ranks`. A worker may
return `outputs` (a list of {prompt_index, token_ids, text}) for the quality metrics and `requests`
(a list of RequestTiming fields, host perf_counter_ns, which is one clock for every process of the
machine) for TTFT / TPOT; those of every rank are merged, by prompt index.

Started by torchrun (`runners/launcher.py`), the launcher's processes are the ranks instead: rank 0
runs the command and hands each launch to the others; nothing is spawned.
"""

from __future__ import annotations

import json
import os
import socket
import tempfile
import time
from pathlib import Path

import torch

from infer_tune import atomic
from infer_tune.errors import ConfigError, InferTuneError
from infer_tune.metrics import memory
from infer_tune.runners import launcher
from infer_tune.runners.base import GenerationRun, Output, Progress, Protocol, RequestTiming, register_runner
from infer_tune.runners.prepared import PreparedModel

BACKENDS = ("gloo", "nccl")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def loopback_store(rank: int, world: int, port: int, timeout_s: float = 300.0):
    """The rendezvous store of spawned ranks, listening on 127.0.0.1 only. torch's TCPStore binds the wildcard
    address whatever MASTER_ADDR says (anyone who reaches the host could read and write its keys); rank 0
    hands it a socket already bound to loopback instead. docs/hardening.md, "Listeners stay on loopback"."""
    import datetime

    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=timeout_s)
    if rank != 0:
        return dist.TCPStore("127.0.0.1", port, world, False, timeout)
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", port))
    listener.listen(128)
    return dist.TCPStore("127.0.0.1", port, world, True, timeout, master_listen_fd=listener.detach())


def run_rank(rank: int, world: int, worker, payload, backend: str, threads: int, setup=None) -> dict:
    """One rank's share, the process group already up: `setup` (untimed), then `worker` between two
    barriers; the reading it returns carries the elapsed time and this process's peaks."""
    import torch.distributed as dist

    torch.set_num_threads(threads)
    local = int(os.environ.get("LOCAL_RANK", rank))
    device = f"cuda:{local}" if backend == "nccl" else "cpu"
    if backend == "nccl":
        torch.cuda.set_device(local)
    failure = None
    if setup is not None:
        try:
            payload = setup(rank, world, payload)
        except Exception as exc:  # every rank learns of it below instead of waiting at a collective
            failure = f"rank {rank}: {type(exc).__name__}: {exc}"
    failures: list = [None] * world
    dist.all_gather_object(failures, failure)  # also the barrier before timing
    if any(failures):
        raise InferTuneError(f"setup failed on {next(f for f in failures if f)}")
    memory.release_and_reset_peak()
    memory.reset_cuda_peak(device)
    dist.barrier()
    start = time.perf_counter()
    reading = dict(worker(rank, world, payload) or {})
    dist.barrier()
    reading["elapsed_s"] = time.perf_counter() - start
    reading["peak_rss_bytes"] = memory.peak_rss_bytes()
    reading["cuda_peak_bytes"] = memory.cuda_peak_bytes(device)
    reading["rank"] = rank
    reading["host"] = socket.gethostname()
    reading["group_rank"] = int(os.environ["GROUP_RANK"]) if "GROUP_RANK" in os.environ else None
    return reading


def _rank_main(rank: int, world: int, worker, payload, port: int, result_dir: str, backend: str,
               threads: int, setup=None) -> None:
    import torch.distributed as dist

    # gloo's own connections listen on the loopback interface's address, not on the host name's
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), GLOO_SOCKET_IFNAME="lo")
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, rank=rank, world_size=world, store=loopback_store(rank, world, port))
    try:
        reading = run_rank(rank, world, worker, payload, backend, threads, setup)
    finally:
        dist.destroy_process_group()
    atomic.write_json(Path(result_dir) / f"rank{rank}.json", reading)


def launch(worker, payload, *, procs: int, backend: str = "gloo", threads: int | None = None,
           setup=None) -> list[dict]:
    """Run `worker` on `procs` spawned ranks (after `setup`, untimed, when given); each rank's reading."""
    import torch.multiprocessing as mp

    if procs < 1:
        raise ConfigError(f"a multi-process run needs at least 1 process, got {procs}")
    if backend not in BACKENDS:
        raise ConfigError(f"distributed backend must be one of {', '.join(BACKENDS)}, got '{backend}'")
    if backend == "nccl" and torch.cuda.device_count() < procs:
        raise ConfigError(f"nccl with {procs} processes needs {procs} GPUs; torch sees {torch.cuda.device_count()}")
    if launcher.joined():
        return launcher.launch(run_rank, worker, payload, procs=procs, backend=backend, threads=threads, setup=setup)
    per_rank = max(1, (threads or torch.get_num_threads()) // procs)
    with tempfile.TemporaryDirectory(prefix="infer-tune-ranks-") as result_dir:
        try:
            mp.start_processes(_rank_main, args=(procs, worker, payload, free_port(), result_dir, backend, per_rank, setup),
                               nprocs=procs, join=True, start_method="spawn")
        except mp.ProcessRaisedException as exc:
            last = str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__
            raise InferTuneError(f"a rank of the multi-process run failed: {last}") from exc
        except mp.ProcessExitedException as exc:
            raise InferTuneError(f"a rank of the multi-process run died: {exc}") from exc
        return [json.loads((Path(result_dir) / f"rank{r}.json").read_text()) for r in range(procs)]


def workload_inputs(inputs, workload, protocol: Protocol) -> dict:
    """The workload as plain lists for workers (`with_inputs`)."""
    batches = [{k: v.tolist() for k, v in batch.items()} for batch in inputs.batches]
    return {"batches": batches, "max_new_tokens": workload.max_new_tokens, "pin_length": protocol.pin_length}


@register_runner("multiprocess")
def run_multiprocess(prepared: PreparedModel, inputs, workload, protocol: Protocol,
                     progress: Progress | None = None) -> GenerationRun:
    """Warmup launches (untimed), then one timed launch per iteration until the protocol is met."""
    options = prepared.runner_options
    if "worker" not in options:
        raise ConfigError("the multiprocess runner needs runner_options['worker']")
    procs = int(options.get("procs", 2))
    args = dict(procs=procs, backend=options.get("backend", "gloo"), threads=torch.get_num_threads(),
                setup=options.get("setup"))
    payload = options.get("payload")
    if options.get("with_inputs"):
        payload = dict(payload or {}, inputs=workload_inputs(inputs, workload, protocol))
    warmup_start = time.perf_counter()
    for i in range(protocol.warmup):
        launch(options["worker"], payload, **args)
        if progress:
            progress("warmup", i + 1, protocol.warmup)
    warmup_s = time.perf_counter() - warmup_start
    iterations, measured_s, ranks = 0, 0.0, []
    while iterations < protocol.min_iterations or measured_s < protocol.min_duration_s:
        ranks = launch(options["worker"], payload, **args)
        measured_s += max(r["elapsed_s"] for r in ranks)
        iterations += 1
        if progress:
            progress("launches", iterations, protocol.min_iterations)
    counters: dict = {"procs": procs, "launch_elapsed_s": [r["elapsed_s"] for r in ranks]}
    for reading in ranks:
        for key, value in (reading.pop("counters", None) or {}).items():
            counters[key] = counters.get(key, 0) + value
    raw_outputs = sorted((o for r in ranks for o in (r.pop("outputs", None) or [])), key=lambda o: o["prompt_index"])
    requests = sorted((RequestTiming(**t) for r in ranks for t in (r.pop("requests", None) or [])),
                      key=lambda t: (t.iteration, t.prompt_index))
    outputs = [Output(prompt_index=o["prompt_index"], text=o.get("text", ""), token_ids=list(o.get("token_ids", [])),
                      prompt_tokens=int(o.get("prompt_tokens", 0)), hit_eos=bool(o.get("hit_eos", False)))
               for o in raw_outputs]
    cuda = [r["cuda_peak_bytes"] for r in ranks if r.get("cuda_peak_bytes") is not None]
    return GenerationRun(
        requests=requests, outputs=outputs, measured_wall_s=measured_s, iterations=iterations, first_call_ms=None,
        warmup_s=warmup_s, peak_rss_bytes=max(r["peak_rss_bytes"] for r in ranks),
        rss_before_bytes=memory.current_rss_bytes(), generated_tokens=sum(len(o.token_ids) for o in outputs),
        batch_size=workload.batch_size if requests else 0, counters=counters, ranks=ranks, cuda_peak_bytes=max(cuda) if cuda else None)
