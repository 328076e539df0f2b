"""bench/mooncake_like.py draws a Mooncake-format trace the trace reader accepts, seeded, within its bounds."""

import importlib.util
import subprocess
import sys
from pathlib import Path

from infer_tune.endpoint.workloads import read_trace, sharing_first_block

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "bench" / "mooncake_like.py"


def _module():
    spec = importlib.util.spec_from_file_location("mooncake_like", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_trace_is_seeded_bounded_and_read_back(tmp_path):
    out = tmp_path / "t.jsonl"
    cmd = [sys.executable, str(SCRIPT), "--requests", "40", "--rate", "0.5", "--max-input", "3000",
           "--prefix-blocks", "3,5", "--seed", "3", "--out", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=60, check=True)
    assert "40 requests" in done.stdout
    first = out.read_text()
    subprocess.run(cmd, capture_output=True, text=True, timeout=60, check=True)
    assert out.read_text() == first  # the same seed, the same trace
    entries, meta = read_trace(out, "mooncake", block_size=512)
    assert meta["rows"] == 40 and meta["skipped"] == 0
    assert all(0 < e.input_length <= 3000 for e in entries)
    assert all(len(e.hash_ids) == -(-e.input_length // 512) for e in entries)  # one id per started block
    assert all(a.arrival_s <= b.arrival_s for a, b in zip(entries, entries[1:]))
    assert all(16 <= e.output_length <= 512 for e in entries)
    assert sharing_first_block(entries) >= 30  # 6 shared prefixes over 40 requests: most open a shared one


def test_stats_count_blocks_seen_before():
    mod = _module()
    rows = [{"timestamp": 0, "input_length": 600, "output_length": 10, "hash_ids": [0, 1]},
            {"timestamp": 5, "input_length": 600, "output_length": 10, "hash_ids": [0, 2]}]
    s = mod.stats(rows)
    assert s["reusable_block_share"] == 0.25 and s["mean_input"] == 600


def test_bad_arguments_exit_2(tmp_path):
    done = subprocess.run([sys.executable, str(SCRIPT), "--rate", "0", "--out", str(tmp_path / "x.jsonl")],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "must be positive" in done.stderr
