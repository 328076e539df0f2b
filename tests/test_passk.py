"""pass@1 scoring: correct, wrong, looping, memory-hungry (sandboxed; hostile code: test_sandbox.py)."""

from __future__ import annotations

import pytest

from infer_tune.metrics import passk, sandbox
from infer_tune.suites import Prompt

# one xdist worker runs every test that starts sandboxed programs (test_sandbox.py checks none is left running)
pytestmark = pytest.mark.xdist_group("sandbox")

# where bubblewrap is missing these scoring tests run unsandboxed (test_sandbox.py fails on CI then)
ISOLATION = "sandbox" if sandbox.available() else "unsafe"

PROBLEM = {
    "task_id": "Toy/0",
    "prompt": 'def add(a, b):\n    """Return a + b."""\n',
    "test": "def check(candidate):\n    assert candidate(2, 3) == 5\n    assert candidate(-1, 1) == 0\n",
    "entry_point": "add",
}


def test_correct_wrong_and_looping_completions():
    # Generous timeout for the finite programs (a busy machine must not flip them), short for the loop.
    items = passk.evaluate([PROBLEM] * 2, ["    return a + b\n", "    return a - b\n"], timeout_s=30.0,
                            isolation=ISOLATION)
    items += passk.evaluate([PROBLEM], ["    while True:\n        pass\n"], timeout_s=1.0, isolation=ISOLATION)
    assert [i.status for i in items] == ["passed", "failed", "timeout"]
    assert "AssertionError" in items[1].detail
    assert passk.score(items) == 1 / 3
    assert passk.pass_at_1([PROBLEM], ["    return a + b\n"], timeout_s=30.0, isolation=ISOLATION) == 1.0


def test_fenced_chat_answer_and_prompt_objects():
    prompt = Prompt(id="Toy/0", text=PROBLEM["prompt"], extra={"test": PROBLEM["test"], "entry_point": "add"})
    answer = "Sure:\n```python\ndef add(a, b):\n    return a + b\n```\n"
    assert passk.pass_at_1([prompt], [answer], timeout_s=30.0, isolation=ISOLATION) == 1.0


def test_limits_hold():
    hungry = "    x = bytearray(4 << 30)\n    return a + b\n"
    network = "    import socket\n    socket.create_connection(('127.0.0.1', 9), 2)\n    return a + b\n"
    for isolation in ("sandbox", "unsafe"):
        if isolation == "sandbox" and not sandbox.available():
            continue  # tests/test_sandbox.py fails on CI when the sandbox is missing
        items = passk.evaluate([PROBLEM] * 2, [hungry, network], timeout_s=30.0, isolation=isolation)
        assert [i.status for i in items] == ["failed", "failed"], (isolation, items)
        assert "MemoryError" in items[0].detail
        assert ("PermissionError" if isolation == "unsafe" else "Error") in items[1].detail
