"""The roofline probe's native read (native/matmul.cpp `stream_read`, env.read_gb_s): it reads every byte (its
checksum is the XOR of every 8-byte word, on sizes that exercise the threads' shares, the 4 streams' remainders
and the tail), and the probe takes the faster of it and torch's sum, so a decode is divided by a read at least as
fast as its own access pattern."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from infer_tune import env


def xor_words(t: torch.Tensor) -> int:
    raw = t.reshape(-1).view(torch.uint8).numpy().tobytes()
    raw += b"\0" * (-len(raw) % 8)
    return int(np.bitwise_xor.reduce(np.frombuffer(raw, dtype=np.uint64))) if raw else 0


@pytest.mark.usefixtures("native_kernels")
@pytest.mark.parametrize("nbytes", [0, 7, 64, 64 * 4 + 8, 64 * 4096 * 3 + 17, 64 * 70001 + 40])
def test_stream_read_reads_every_byte(nbytes):
    gen = torch.Generator().manual_seed(nbytes)
    t = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen)
    other = torch.randint(-128, 128, (333,), dtype=torch.int8, generator=gen)
    read = torch.ops.infer_tune_native.stream_read
    assert read in env.FAST_READS  # registered when the kernels loaded
    got = read([t, other]) & (2**64 - 1)
    assert got == xor_words(t) ^ xor_words(other)
    if nbytes > 64:
        t[nbytes // 2] ^= 1  # one changed bit anywhere changes the checksum: nothing skipped
        assert read([t, other]) & (2**64 - 1) != got


def test_the_probe_takes_the_faster_read(monkeypatch):
    """With a native read that returns at once, the probe reports its (much higher) rate; without one, torch's."""
    tensors = [torch.ones(1 << 20, dtype=torch.uint8)]
    monkeypatch.setattr(env, "FAST_READS", [])
    torch_only = env.read_gb_s(tensors)
    calls = []
    env.register_read(lambda views: calls.append(len(views)))
    assert env.read_gb_s(tensors) > torch_only and calls == [1, 1]
