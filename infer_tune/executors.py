"""Where configs are measured: here (the default), or as Ray tasks on the nodes of a Ray cluster.

`--executor ray` (`bench --recipe`, `tune`; the optional extra `infer-tune[ray]`): each config runs as one
Ray task that measures it *together with the baseline it is compared against* on the node it landed
on, through the engine's own entry point (`infer_tune.sweep.run_configs`) with a node-local runs
folder, so every ratio is against that node's own baseline (the fingerprint holds the machine key:
a baseline is reused only on the same host). A task asks for a whole measuring slot of a node: one
GPU on CUDA, else one unit of the custom resource `infer_tune_node` that each CPU node is started
with (`ray start ... --resources '{"infer_tune_node": 1}'`), so two measurements never share a
machine. The task returns the files of its result folders; the driver writes them into the local
`--out` through the atomic writer (`results.save_run`). A task lost with its node or its worker is
retried (`max_retries`); a folder lands at most once (its run id, and for configs the fingerprint,
already in `--out` is skipped). The node-local folders live under $INFER_TUNE_RAY_DIR (default
/tmp/infer-tune-ray/<job>), with one `.attempts/<config>.<pid>` marker per attempt that reached its
config (written when its measurement begins). Commands and a cluster walk-through: docs/scale.md.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import socket
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

from infer_tune import atomic, jsonsafe
from infer_tune.document import ResultDocument
from infer_tune.errors import ConfigError, InferTuneError, ResultError

EXECUTORS = ("local", "ray")
NODE_RESOURCE = "infer_tune_node"
_CURRENT: list = []


def current():
    """The executor scenarios hand their configs to (None: measure here, the default)."""
    return _CURRENT[-1] if _CURRENT else None


@contextlib.contextmanager
def use(executor) -> Iterator[None]:
    _CURRENT.append(executor)
    try:
        yield
    finally:
        _CURRENT.pop()
        if executor is not None:
            executor.close()


def make(name: str, address: str | None = None, *, device: str = "cpu", max_retries: int = 2):
    """The executor a `--executor` value names (None for local)."""
    if name not in EXECUTORS:
        raise ConfigError(f"--executor must be one of {', '.join(EXECUTORS)}, got '{name}'")
    if name == "local":
        if address:
            raise ConfigError("--ray-address needs --executor ray")
        return None
    return RayExecutor(address, device=device, max_retries=max_retries)


def _folder_files(run_dir: str) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in Path(run_dir).iterdir() if p.is_file()}


def measure_task(spec, config, job: str) -> dict:
    """On a node: the config (or a list of configs, measured together) and their baseline, into a node-local
    runs folder; the files of every result folder."""
    from infer_tune.scenarios.common import open_run
    from infer_tune.sweep import run_configs

    base = os.environ.get("INFER_TUNE_RAY_DIR") or Path(tempfile.gettempdir()) / "infer-tune-ray"
    node_dir = Path(base) / job
    node_dir.mkdir(parents=True, exist_ok=True)
    attempts = node_dir / ".attempts"
    attempts.mkdir(exist_ok=True)
    configs = list(config) if isinstance(config, (list, tuple)) else [config]
    label = "+".join(c.label() if hasattr(c, "label") else type(c).__name__ for c in configs)
    marker = attempts / f"{label}.{os.getpid()}"

    measuring = []

    def progress(stage: str, step: int, count: int | None) -> None:
        if measuring and stage != "configs" and not stage.startswith("waiting") and not marker.exists():
            # a measuring stage of run_configs (warming, a round, a pass): the config is being measured now
            marker.write_text(json.dumps({"pid": os.getpid(), "started": time.time(), "stage": stage}))

    local = dataclasses.replace(spec, out_dir=node_dir)
    run = open_run(local, progress)
    measuring.append(True)
    with atomic.scratch() as scratch:
        run.ctx.scratch_dir = scratch
        baseline, docs = run_configs(run.loaded, run.inputs, local.workload, local.protocol, configs, run.ctx,
                                     resume=False, reuse_baseline=True, measure_ppl=local.measure_ppl,
                                     execute=local.execute)
    node = {"hostname": socket.gethostname(), "pid": os.getpid()}
    try:
        import ray

        node["node_id"] = ray.get_runtime_context().get_node_id()
    except Exception:  # noqa: BLE001  (outside Ray, e.g. a direct call)
        pass
    return {"node": node, "folders": [{"technique": d.technique, "run_id": d.run_id,
                                       "fingerprint": d.fingerprint, "files": _folder_files(d.location)}
                                      for d in (baseline, *docs)]}


def _messages_to_stderr() -> None:
    """Ray's driver prints the cluster's messages (a worker that died, ...) on stdout; stdout is infer-tune's
    own output (`--json`), so they go to stderr."""
    from ray._private import worker

    original = getattr(worker.print_to_stdstream, "__wrapped__", worker.print_to_stdstream)

    def to_stderr(data, ignore_prefix: bool):
        return original(dict(data, is_err=True), ignore_prefix)

    to_stderr.__wrapped__ = original
    worker.print_to_stdstream = to_stderr


def ray_init_args(address: str | None) -> dict:
    """`ray.init`'s arguments: the driver's own listeners (its core worker's gRPC port) stay on 127.0.0.1
    unless the user names a cluster elsewhere (`--ray-address HOST:PORT` / `RAY_ADDRESS` off this host).
    Ray has no authentication: a port it opens beyond loopback runs anyone's code (docs/scale.md)."""
    named = address or os.environ.get("RAY_ADDRESS") or "auto"
    args = {"address": address or "auto", "log_to_driver": False, "logging_level": "ERROR"}
    host = named.rsplit(":", 1)[0] if ":" in named and not named.startswith("ray://") else named
    if host in ("auto", "127.0.0.1", "localhost"):
        args["_node_ip_address"] = "127.0.0.1"
    return args


class RayExecutor:
    """Configs as Ray tasks (module docstring); `run_bench` is what `scenarios.bench` calls."""

    def __init__(self, address: str | None, *, device: str = "cpu", max_retries: int = 2) -> None:
        try:
            import ray
        except ImportError:
            raise ConfigError("--executor ray needs Ray: pip install 'infer-tune[ray]'") from None
        self.ray = ray
        self.device = device
        self.max_retries = max_retries
        self.job = time.strftime("%Y%m%d-%H%M%S-") + uuid.uuid4().hex[:8]
        self.landed = 0
        self.skipped = 0
        self.landed_ids: set[str] = set()  # run ids this executor wrote: the only ones its sweep hooks rewrite
        _messages_to_stderr()
        if not ray.is_initialized():
            try:
                ray.init(**ray_init_args(address))
            except (ConnectionError, RuntimeError, ValueError) as exc:
                raise ConfigError(f"cannot reach a Ray cluster at {address or 'auto'}: {exc} (start one with "
                                  f"`ray start --head`, or pass --ray-address HOST:PORT)") from None
        totals = ray.cluster_resources()
        key = "GPU" if device.startswith("cuda") else NODE_RESOURCE
        if totals.get(key, 0) < 1:
            raise ConfigError(f"the Ray cluster offers no '{key}' resource: start each node with "
                              + ("GPUs" if key == "GPU" else f"--resources '{{\"{NODE_RESOURCE}\": 1}}'")
                              + " (docs/scale.md)")
        self.slots = int(totals[key])

    def options(self) -> dict:
        request = {"num_gpus": 1} if self.device.startswith("cuda") else {"resources": {NODE_RESOURCE: 1}}
        return dict(request, num_cpus=0, max_retries=self.max_retries, retry_exceptions=False)

    def submit(self, spec, configs: list) -> list:
        """One task per entry of `configs` (an entry may be a list: configs measured together in one task)."""
        task = self.ray.remote(measure_task).options(**self.options())
        return [task.remote(spec, config, self.job) for config in configs]

    def collect(self, refs: list, out_dir: Path, progress=None) -> list[tuple[ResultDocument, list[ResultDocument]]]:
        """Wait for every task; land its folders in `out_dir`; (baseline, config docs) per task, in order."""
        pending = {ref: i for i, ref in enumerate(refs)}
        answers: list = [None] * len(refs)
        while pending:
            ready, _ = self.ray.wait(list(pending), num_returns=1)
            for ref in ready:
                try:
                    answer = self.ray.get(ref)
                except self.ray.exceptions.RayError as exc:
                    raise InferTuneError(f"a Ray task failed after {self.max_retries} retries: "
                                         f"{str(exc).strip().splitlines()[-1][:300]}") from None
                docs = [self.land(folder, answer["node"], out_dir) for folder in answer["folders"]]
                answers[pending.pop(ref)] = (docs[0], docs[1:])
                if progress:
                    progress("configs (ray)", len(refs) - len(pending), len(refs))
        return answers

    def land(self, folder: dict, node: dict, out_dir: Path) -> ResultDocument:
        """Write one returned result folder into `out_dir` (once); its document as saved there. The worker's
        answer is JSON from another machine: validated (`results.validate`) and made a ResultDocument here."""
        from infer_tune import results
        from infer_tune.sweep import find_result

        out_dir = Path(out_dir)
        files = dict(folder["files"])
        try:  # a worker's answer is checked before any path is joined with it (docs/hardening.md)
            run_id = results.check_run_id(folder.get("run_id"), "a Ray worker returned run id")
            data = jsonsafe.loads(files.pop("result.json"))
            if not isinstance(data, dict) or data.get("run_id") != run_id:
                raise ResultError(f"a Ray worker returned run {run_id} whose result.json names another run id")
            if problem := results.validate(data):
                raise ResultError(f"a Ray worker returned run {run_id} whose result {problem}")
            doc = ResultDocument.from_dict(data)
            # what the worker's sweep concluded over the row (saved there beside result.json): part of the
            # result saved here, which is a new save
            concluded = sorted((int(m.group(1) or 1), name) for name in list(files)
                               if (m := results.CONCLUSION.fullmatch(str(name))))
            records = [jsonsafe.loads(files.pop(name)) for _, name in concluded]
            if records and isinstance(records[-1], dict):
                doc = ResultDocument.from_dict(doc.with_conclusion(
                    records[-1].get("metrics"), records[-1].get("sections"), source="a Ray worker's conclusion", check=False).to_dict())
                if problem := results.validate(doc):
                    raise ResultError(f"a Ray worker returned run {run_id} whose concluded result {problem}")
            bad = [name for name in files if not results.FILE_NAME.fullmatch(str(name))]
            if bad:
                raise ResultError(f"a Ray worker returned run {run_id} with a file named {str(bad[0])[:80]!r}, not a "
                                  "plain file name")
        except (ValueError, TypeError, KeyError) as exc:
            raise ResultError(f"a Ray worker returned a malformed result folder: {str(exc)[:200]}") from None
        existing = out_dir / run_id
        if existing.is_dir():
            self.skipped += 1
            return results.load_result(existing)
        if folder["technique"] != "baseline" and folder.get("fingerprint"):
            found = find_result(out_dir, folder["fingerprint"])
            if found is not None:
                self.skipped += 1
                return found
        doc.env["executor"] = dict(node, kind="ray", job=self.job)
        outputs = [json.loads(line) for line in files.pop("outputs.jsonl", b"").decode().splitlines() if line]
        landed = results.save_run(out_dir, doc, outputs, extra_files=files).result
        self.landed += 1
        self.landed_ids.add(landed.run_id)
        return landed

    def run_configs(self, spec, configs: list, progress=None) -> tuple[ResultDocument, list[ResultDocument]]:
        """Every config (with its node's baseline) as a Ray task, landed in spec.out_dir: (a baseline, docs)."""
        from infer_tune.results import runs_lock
        from infer_tune.sweep import conclude_sweep

        refs = self.submit(spec, list(configs))
        with runs_lock(spec.out_dir):
            pairs = self.collect(refs, Path(spec.out_dir), progress)
            docs = [doc for _, task_docs in pairs for doc in task_docs]
            docs = conclude_sweep(docs, own=self.landed_ids)  # never a folder that was there before it landed
        return pairs[0][0], docs

    def run_together(self, spec, configs: list, progress=None) -> tuple[ResultDocument, list[ResultDocument]]:
        """Configs compared with each other (tune's contenders): one task, so they share one node and rounds."""
        from infer_tune.results import runs_lock

        refs = self.submit(spec, [list(configs)])
        with runs_lock(spec.out_dir):
            (baseline, docs), = self.collect(refs, Path(spec.out_dir), progress)
        return baseline, docs

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.ray.shutdown()
