"""The suite's own text for llama.cpp's calibration and quality tools (docs/endpoint.md, "Launching an engine").

- `suite_text(spec)`: the workload's prompts and references as one text file (the calibration set of
  `llama-imatrix` and the text `llama-perplexity` scores), cached by its content digest.
- `imatrix_gguf(checkpoint, fmt, text)`: an importance matrix of the f16 GGUF on that text (`llama-imatrix`),
  then `llama-quantize --imatrix` to `fmt` (Q8_0 embeddings and output, as the uncalibrated twin); cached
  beside the other GGUFs as `imatrix-<fmt>-<text digest[:12]>.gguf` with its `.json` (and the `.imatrix`).
- `perplexity(gguf, text)`: `llama-perplexity` on the text, its final estimate parsed (`parse_perplexity`),
  cached per (GGUF digest, text digest, context, the KV cache / flash attention flags of the launch).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path

from infer_tune import atomic, paths
from infer_tune.engines import llamacpp
from infer_tune.errors import ConfigError

FINAL = re.compile(r"Final estimate:\s*PPL\s*=\s*([0-9.]+)\s*\+/-\s*([0-9.]+)")
PPL_CONTEXT = 128  # tokens per chunk (llama-perplexity needs 2 chunks at least)
PPL_CHUNKS = 16  # at most 16 x 128 = 2048 tokens scored per GGUF: seconds on 2 cores for a 135M model
TEXT_CHARS = 24_000  # the suite's text is cut at this many characters (about 6k tokens), in suite order


def suite_text(prompts, references=(), max_chars: int = TEXT_CHARS) -> Path:
    """The prompts' text, each followed by its reference when it has one (what the suite says), one per
    paragraph in suite order up to `max_chars`, in a cached file."""
    references = list(references) or [None] * len(prompts)
    parts, size = [], 0
    for prompt, reference in zip(prompts, references):
        for piece in (prompt, reference):
            if piece and size < max_chars:
                parts.append(str(piece))
                size += len(str(piece)) + 2
    if not parts:
        raise ConfigError("the suite has no text to calibrate or score on")
    text = ("\n\n".join(parts) + "\n")[:max_chars]
    digest = hashlib.sha256(text.encode()).hexdigest()
    path = paths.home() / "data" / "suite-text" / f"{digest[:16]}.txt"
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic.write_bytes(path, text.encode())
    return path


def text_digest(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def imatrix_gguf(checkpoint: str | Path, fmt: str, text: Path, *, threads: int | None = None,
                 timeout_s: float = 1800.0) -> Path:
    """`fmt` quantized with an importance matrix computed on `text` (module docstring)."""
    fmt = llamacpp.check_format(fmt)
    if fmt == "f16":
        raise ConfigError("an importance matrix calibrates a quantized type, not f16")
    info = llamacpp.build_info()
    folder = llamacpp.gguf_dir(checkpoint, info)
    tag = text_digest(text)[:12]
    target = folder / f"imatrix-{fmt}-{tag}.gguf"
    if target.is_file():
        return target
    f16 = llamacpp.gguf(checkpoint, "f16", threads=threads, info=info)
    matrix = folder / f"imatrix-{tag}.imatrix.gguf"
    pid = os.getpid()
    if not matrix.is_file():
        staged = folder / f".imatrix-{tag}.partial-{pid}.gguf"
        cmd = [str(llamacpp.require("llama-imatrix")), "-m", str(f16), "-f", str(text), "-o", str(staged),
               "-c", str(PPL_CONTEXT), "--no-ppl"] + (["-t", str(threads)] if threads else [])
        try:
            llamacpp._run(cmd, "llama-imatrix", timeout_s)
            written = staged if staged.is_file() else next(folder.glob(f".imatrix-{tag}.partial-{pid}*"), None)
            if written is None:
                raise llamacpp.LlamaCppError(f"llama-imatrix wrote no file at {staged}")
            written.replace(matrix)
        finally:
            staged.unlink(missing_ok=True)
    staged = folder / f".imatrix-{fmt}-{tag}.partial-{pid}.gguf"
    qtype = llamacpp.quant_type(fmt)
    cmd = [str(llamacpp.require("llama-quantize")), "--imatrix", str(matrix), *llamacpp.head_flags(fmt), str(f16),
           str(staged), qtype] + ([str(threads)] if threads else [])
    try:
        llamacpp._run(cmd, f"llama-quantize --imatrix {qtype}", timeout_s)
        meta = {"format": f"imatrix-{fmt}", "type": qtype, "checkpoint": str(checkpoint),
                "imatrix": {"path": str(matrix), "text": str(text), "text_sha256": text_digest(text)},
                "llama_cpp": llamacpp._version_facts(info), "command": [Path(cmd[0]).name] + cmd[1:],
                "bytes": staged.stat().st_size}
        atomic.write_json(target.with_suffix(".json"), meta)
        staged.replace(target)
    finally:
        staged.unlink(missing_ok=True)
    return target


def parse_perplexity(text: str) -> tuple[float, float]:
    """(PPL, its +/-) from llama-perplexity's `Final estimate: PPL = 12.3456 +/- 0.789` line."""
    match = FINAL.search(text or "")
    if not match:
        raise llamacpp.LlamaCppError("llama-perplexity printed no final estimate")
    return float(match.group(1)), float(match.group(2))


def perplexity(gguf: Path, text: Path, *, threads: int | None = None, context: int = PPL_CONTEXT,
               timeout_s: float = 600.0, flags: list[str] | tuple[str, ...] = ()) -> dict:
    """{ppl, ppl_stderr, context, text_sha256, command} of `gguf` on `text`, cached. `flags`: llama.cpp
    options that change what is computed (a KV cache type `-ctk q8_0`, flash attention `-fa on`), part of
    the cache key."""
    from infer_tune import contenthash

    flags = [str(f) for f in flags]
    tag = ("-" + hashlib.sha256(" ".join(flags).encode()).hexdigest()[:8]) if flags else ""
    key = f"{contenthash.file_digest(gguf)[:16]}-{text_digest(text)[:12]}-c{context}x{PPL_CHUNKS}{tag}"
    cache = paths.home() / "data" / "llama-perplexity" / f"{key}.json"
    try:
        return json.loads(cache.read_text())
    except (OSError, ValueError):
        pass
    cmd = [str(llamacpp.require("llama-perplexity")), "-m", str(gguf), "-f", str(text), "-c", str(context),
           "-b", str(context), "--chunks", str(PPL_CHUNKS)] + (["-t", str(threads)] if threads else []) + flags
    import subprocess

    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, check=False,
                              stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        raise llamacpp.LlamaCppError(f"llama-perplexity did not finish within {timeout_s:g} s") from None
    out = proc.stdout + proc.stderr
    if proc.returncode != 0:
        tail = " | ".join(out.strip().splitlines()[-3:])
        raise llamacpp.LlamaCppError(f"llama-perplexity failed (exit {proc.returncode}): {tail}")
    ppl, err = parse_perplexity(out)
    found = {"ppl": ppl, "ppl_stderr": err, "context": context, "chunks": PPL_CHUNKS, "text_sha256": text_digest(text),
             "command": [Path(cmd[0]).name] + cmd[1:]}
    cache.parent.mkdir(parents=True, exist_ok=True)
    atomic.write_json(cache, found)
    return found
