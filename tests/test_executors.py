"""The executor choice and the Ray executor's landing of returned result folders (no cluster needed):
each folder lands in --out once, by run id and, for configs, by fingerprint; the leaderboard groups
rows by host. The two-node Ray run itself is tests/test_ray_executor.py."""

from __future__ import annotations

import json

import pytest
from result_docs import make_result

from infer_tune import executors
from infer_tune.errors import ConfigError
from infer_tune.results import find_results


def test_make_names_the_executor():
    assert executors.make("local") is None and executors.current() is None
    with pytest.raises(ConfigError, match="--executor must be one of"):
        executors.make("dask")
    with pytest.raises(ConfigError, match="--ray-address needs --executor ray"):
        executors.make("local", "10.0.0.1:6379")


def _folder(doc: dict) -> dict:
    return {"technique": doc["technique"], "run_id": doc["run_id"], "fingerprint": doc.get("fingerprint"),
            "files": {"result.json": json.dumps(doc).encode(), "outputs.jsonl": b'{"prompt_index": 0}\n',
                      "plot.png": b"\x89PNG"}}


def test_a_returned_folder_lands_once(tmp_path):
    landing = object.__new__(executors.RayExecutor)  # its landing only: no cluster
    landing.job, landing.landed, landing.skipped, landing.landed_ids = "job1", 0, 0, set()
    node = {"hostname": "n1", "pid": 1}
    base = make_result("20260101-000000-baseline-a")
    config = dict(make_result("20260101-000001-quantize-b", technique="quantize", seed=1), fingerprint="fp-b")
    retried = dict(config, run_id="20260101-000009-quantize-c")  # the same measurement from a retried task
    for doc in (base, config, base, retried):
        landing.land(_folder(doc), node, tmp_path)
    landed = find_results(tmp_path)
    assert sorted(d["run_id"] for d in landed) == [base["run_id"], config["run_id"]]
    assert landing.landed == 2 and landing.skipped == 2
    saved = tmp_path / config["run_id"]
    assert (saved / "plot.png").read_bytes() == b"\x89PNG" and (saved / "outputs.jsonl").is_file()
    assert json.loads((saved / "result.json").read_text())["env"]["executor"]["kind"] == "ray"
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".") and "lock" not in p.name]


def test_leaderboard_groups_rows_by_host():
    from infer_tune.report.leaderboard import build

    docs = []
    for i, machine in enumerate(["A", "B", "A", "B"]):
        doc = make_result(f"run{i}", technique="quantize", seed=i)
        doc["env"]["machine"] = machine
        docs.append(doc)
    frame = build(docs)
    assert list(frame["run_id"]) in (["run0", "run2", "run1", "run3"], ["run1", "run3", "run0", "run2"])
    assert frame["host"].nunique() == 2 and frame["host"].str.startswith("host-").all()


@pytest.mark.parametrize("change, message", [
    ({"run_id": "../escaped"}, "a Ray worker returned run id '../escaped' is not a run id"),
    ({"run_id": "/tmp/abs"}, "is not a run id"),
    ({"run_id": ".hidden"}, "is not a run id"),
    ({"files": {"../../outside.png": b"x"}}, "with a file named '../../outside.png', not a plain file name"),
    ({"doc_run_id": "../other"}, "whose result.json names another run id"),
])
def test_a_returned_folder_cannot_land_outside_out(tmp_path, change, message):
    """A worker's run id with `../` (or a file name with one) is refused before any path is joined."""
    from infer_tune.errors import ResultError

    landing = object.__new__(executors.RayExecutor)
    landing.job, landing.landed, landing.skipped = "job1", 0, 0
    out = tmp_path / "a" / "out"
    out.mkdir(parents=True)
    doc = dict(make_result("20260101-000001-quantize-b", technique="quantize", seed=1), fingerprint="fp-b")
    if "doc_run_id" in change:
        doc["run_id"] = change["doc_run_id"]
    folder = _folder(doc)
    folder["run_id"] = change.get("run_id", "20260101-000001-quantize-b")
    folder["files"].update(change.get("files", {}))
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    with pytest.raises(ResultError, match=message.replace("(", r"\(").replace(".", r"\.")):
        landing.land(folder, {"hostname": "n1", "pid": 1}, out)
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before
    assert landing.landed == 0
