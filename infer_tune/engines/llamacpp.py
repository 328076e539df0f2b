"""llama.cpp at its best: its tools from one pinned source, GGUFs of the checkpoint infer-tune quantizes,
and the fastest of those formats on this host (docs/endpoint.md, "llama.cpp at its best").

- The tools (`llama-server`, `llama-quantize`, `llama-bench`, `llama-imatrix`, `llama-perplexity`) are built
  by `scripts/build-llama-cpp.sh` from the llama.cpp that the llama-cpp-python sdist on PyPI vendors (Release,
  `GGML_NATIVE=ON`) into `$INFER_TUNE_HOME/bin`, beside `llama-cpp.json`: the llama.cpp commit and build
  number, the source folder (its `convert_hf_to_gguf.py` and `gguf-py`) and the `system_info` line.
  `tool(name)` finds one: `$LLAMA_SERVER` / `$LLAMA_QUANTIZE` / ... (the name upper-cased, `-` as `_`),
  then `$INFER_TUNE_HOME/bin`, then PATH.
- `gguf(checkpoint, fmt)`: the checkpoint folder infer-tune loads (for a built-in model, the safetensors
  checkpoint `models.resolve` made of its shipped GGUF) converted to f16 by that source's
  `convert_hf_to_gguf.py`, then `llama-quantize`d to `q4_0`, `q4_k_m` or `q8_0` with Q8_0 token embeddings
  and output tensor. Cached in `$INFER_TUNE_HOME/gguf/<checkpoint sha256[:16]>/<llama.cpp version>/`, so a
  changed checkpoint or another llama.cpp build makes new files; each GGUF has a `.json` beside it (the
  checkpoint's digest, the llama.cpp version, the commands).
- `best(checkpoint, prompt_lengths, n_gen, threads)`: every format timed by one `llama-bench` call at the
  workload's own prompt lengths (`-p`) and decode length (`-n`), `-r` repetitions, JSON out; `fastest`
  picks by the objective (`e2e`: the mean over the prompt lengths of prefill time plus `n_gen` decode
  steps; `decode`: decode tok/s; `prefill`: mean prefill time). The record (`Best.to_dict`) keeps the
  commit, build number, `system_info`, llama-bench's `cpu_info`, the argv and every format's figures:
  what a reference row carries.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from infer_tune import atomic, paths
from infer_tune.errors import ConfigError, InferTuneError

TOOLS = ("llama-server", "llama-quantize", "llama-bench", "llama-imatrix", "llama-perplexity")
# ours -> llama-quantize's; the non-linear 4-bit types (IQ4_XS 4.25 bits a weight, IQ4_NL 4.5) need no importance
# matrix but gain most from one (engines.calibrate)
QUANT_TYPES = {"f16": "F16", "q4_0": "Q4_0", "q4_k_m": "Q4_K_M", "q8_0": "Q8_0", "q4_k_s": "Q4_K_S",
               "iq4_xs": "IQ4_XS", "iq4_nl": "IQ4_NL"}
BEST_FORMATS = ("q4_0", "q4_k_m", "q8_0")  # the candidates of the reference row
OBJECTIVES = ("e2e", "decode", "prefill")
BUILD_INFO = "llama-cpp.json"
BUILD_HINT = "build them with scripts/build-llama-cpp.sh"


class LlamaCppError(InferTuneError):
    """A llama.cpp tool failed (the message holds its last lines)."""

    exit_code = 1


# --------------------------------------------------------------------------- the tools
AMX_VARIANT = "amx"  # a second build with llama.cpp's AMX kernels: $INFER_TUNE_HOME/bin/amx/, $LLAMA_SERVER_AMX
AMX_HINT = "GGML_AMX=ON VARIANT=amx TARGETS=llama-server scripts/build-llama-cpp.sh"


def tool(name: str, variant: str | None = None) -> Path | None:
    """The tool's executable: `$LLAMA_<NAME>`, `$INFER_TUNE_HOME/bin/<name>`, or on PATH (None: none).
    `variant` (AMX_VARIANT): another build of it, `$LLAMA_<NAME>_<VARIANT>` or `$INFER_TUNE_HOME/bin/<variant>/<name>`
    only (never PATH's: that is the default build).

    One named by the environment is the user's to vouch for; one in the home is run only when every path
    from the home down to it is this account's and not writable by others (`paths.untrusted`), else refused
    in one line: another account could have put its own program there (docs/hardening.md)."""
    env_name = name.upper().replace("-", "_") + (f"_{variant.upper()}" if variant else "")
    given = os.environ.get(env_name)
    if given and Path(given).expanduser().is_file() and os.access(Path(given).expanduser(), os.X_OK):
        return Path(given).expanduser()
    home = paths.home()
    candidate = home / "bin" / (f"{variant}/{name}" if variant else name)
    if candidate.is_file() and os.access(candidate, os.X_OK):
        problem = paths.untrusted(candidate, home)
        if problem:
            raise ConfigError(f"refusing to run {candidate}: {problem}; remove it and rebuild with "
                              f"scripts/build-llama-cpp.sh (or set {env_name} to a binary "
                              "you trust)")
        return candidate
    if variant:
        return None
    found = shutil.which(name)
    return Path(found) if found else None


def require(name: str) -> Path:
    found = tool(name)
    if found is None:
        raise ConfigError(f"llama.cpp's {name} is not built here: {BUILD_HINT} (or set "
                          f"{name.upper().replace('-', '_')} to its path)")
    return found


def missing_tools(names=("llama-quantize", "llama-bench")) -> list[str]:
    return [n for n in names if tool(n) is None]


VERSION_LINES = (re.compile(r"version:.*\(build\s+(\d+),\s*commit\s+([0-9a-fA-F]+|unknown)\)"),
                 re.compile(r"version:\s*(\d+)\s*\(([0-9a-fA-F]+|unknown)\)"))


def parse_version(text: str) -> dict:
    """`{build_number, commit}` from a tool's `--version` output, `version: 0.5.0-dev (build 1, commit
    0c1e570)` or the older `version: 1 (0c1e570)` ({} when it has no version line)."""
    for pattern in VERSION_LINES:
        match = pattern.search(text or "")
        if match:
            return {"build_number": int(match.group(1)), "commit": match.group(2)}
    return {}


def build_info() -> dict:
    """What the build recorded (`$INFER_TUNE_HOME/bin/llama-cpp.json`), else what `llama-bench --version`
    says; {} when no llama.cpp tool is here."""
    recorded = paths.home() / "bin" / BUILD_INFO
    _trust_record(recorded)
    try:
        info = json.loads(recorded.read_text())
        if isinstance(info, dict) and info.get("commit"):
            return info
    except (OSError, ValueError):
        pass
    binary = tool("llama-bench") or tool("llama-server")
    if binary is None:
        return {}
    proc = subprocess.run([str(binary), "--version"], capture_output=True, text=True, timeout=60, check=False)
    return {**parse_version(proc.stdout + proc.stderr), "source": os.environ.get("LLAMA_CPP_SOURCE")}


def _trust_record(recorded: Path) -> None:
    """The build's record names the source whose script is run: it is read only when it and the folders from
    the home down to it are this account's and writable by no one else (as the binaries beside it), else
    refused in one line (docs/hardening.md)."""
    if not recorded.exists():
        return
    problem = paths.untrusted(recorded, paths.home())
    if problem:
        raise ConfigError(f"refusing to read {recorded}: {problem}; it names the llama.cpp source whose "
                          f"convert_hf_to_gguf.py is run: remove it and rebuild with scripts/build-llama-cpp.sh "
                          "(or set LLAMA_CPP_SOURCE to a llama.cpp folder you trust)")


def _trust_source(folder: Path) -> None:
    """A source folder named by the build's record: its `convert_hf_to_gguf.py` and the `gguf-py` package it
    imports (every file and folder), and every folder above them, belong to this user or root and are not
    writable by others, else refused in one line. One named by `$LLAMA_CPP_SOURCE` is the user's to vouch for."""
    items = [folder / "convert_hf_to_gguf.py"]
    package = folder / "gguf-py"
    if package.is_dir():
        items.append(package)
        items += sorted(package.rglob("*"))[:10_000]
    for item in items:
        problem = paths.untrusted_anywhere(item)
        if problem:
            raise ConfigError(f"refusing to run {folder / 'convert_hf_to_gguf.py'}: {problem}; rebuild with "
                              f"scripts/build-llama-cpp.sh (or set LLAMA_CPP_SOURCE to a llama.cpp folder you trust)")


def version_key(info: dict) -> str:
    """The cache key of a llama.cpp build: `b<build number>-<commit>` (its GGUFs are kept apart)."""
    if not info:
        raise ConfigError(_not_built("llama-server", "llama-bench"))
    if not info.get("commit"):
        raise ConfigError(f"llama.cpp's version is unknown (no {BUILD_INFO} and no version line): {BUILD_HINT}")
    return f"b{info.get('build_number', 0)}-{info['commit']}"


def _not_built(*names: str) -> str:
    """One line for llama.cpp tools found nowhere: each binary, the variable that points at it (and what it is
    set to, when that is no executable file), where else it was looked for, and how to build it."""
    said = []
    for name in names:
        variable = name.upper().replace("-", "_")
        given = os.environ.get(variable)
        said.append(f"{name} (${variable} is {given!r}, not an executable file)" if given
                    else f"{name} (${variable} unset)")
    return (f"llama.cpp is not built here: no {' or '.join(said)}, none in {paths.home() / 'bin'} or on PATH, "
            f"no {BUILD_INFO}: {BUILD_HINT}, or set {' / '.join(n.upper().replace('-', '_') for n in names)} "
            "to the binary")


def source_dir(info: dict | None = None) -> Path:
    """The llama.cpp source the tools were built from (its `convert_hf_to_gguf.py`): `$LLAMA_CPP_SOURCE`,
    else the one the build recorded."""
    info = build_info() if info is None else info
    given = os.environ.get("LLAMA_CPP_SOURCE") or info.get("source")
    if not given or not isinstance(given, str) or not (Path(given) / "convert_hf_to_gguf.py").is_file():
        raise ConfigError(f"no llama.cpp source with convert_hf_to_gguf.py (got {given!r}): {BUILD_HINT}, "
                          "or set LLAMA_CPP_SOURCE to the llama.cpp folder")
    if not os.environ.get("LLAMA_CPP_SOURCE"):
        _trust_source(Path(given))
    return Path(given)


def _run(cmd: list[str], what: str, timeout_s: float) -> str:
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, check=False,
                              stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        raise LlamaCppError(f"{what} did not finish within {timeout_s:g} s") from None
    if proc.returncode != 0:
        tail = " | ".join((proc.stderr or proc.stdout).strip().splitlines()[-4:])
        raise LlamaCppError(f"{what} failed (exit {proc.returncode}): {tail}")
    return proc.stdout


# --------------------------------------------------------------------------- GGUFs of the checkpoint
DEFAULT_HEAD = "-default"  # a format with this suffix keeps llama-quantize's own types for the head and embedding


def check_format(fmt: str) -> str:
    """A GGUF format name: a QUANT_TYPES key, or a quantized one with the `-default` suffix (llama-quantize's
    own output-tensor and token-embedding types instead of Q8_0)."""
    fmt = fmt.lower()
    base = fmt.removesuffix(DEFAULT_HEAD)
    if base not in QUANT_TYPES or (fmt != base and base == "f16"):
        raise ConfigError(f"GGUF type must be one of {', '.join(QUANT_TYPES)} (a 4- or 8-bit one may end in "
                          f"{DEFAULT_HEAD}: llama-quantize's own head type), got {fmt!r}")
    return fmt


def quant_type(fmt: str) -> str:
    """llama-quantize's type name of a format (`q4_0-default` -> `Q4_0`)."""
    return QUANT_TYPES[check_format(fmt).removesuffix(DEFAULT_HEAD)]


def head_flags(fmt: str) -> list[str]:
    """llama-quantize's flags for the token embedding and output tensor of `fmt`: Q8_0 both, or none (its
    own choice) for a `-default` format."""
    if check_format(fmt).endswith(DEFAULT_HEAD):
        return []
    return ["--token-embedding-type", "q8_0", "--output-tensor-type", "q8_0"]


def gguf_dir(checkpoint: str | Path, info: dict | None = None) -> Path:
    """`$INFER_TUNE_HOME/gguf/<checkpoint sha256[:16]>/<llama.cpp version>/`."""
    from infer_tune import contenthash

    folder = Path(checkpoint)
    if not (folder / "config.json").is_file():
        raise ConfigError(f"{checkpoint} is not a checkpoint folder (no config.json)")
    info = build_info() if info is None else info
    return paths.home() / "gguf" / contenthash.tree_digest(folder)[:16] / version_key(info)


def gguf(checkpoint: str | Path, fmt: str, *, threads: int | None = None, info: dict | None = None,
         timeout_s: float = 1800.0) -> Path:
    """The checkpoint as a GGUF of type `fmt` (module docstring), made once and cached."""
    from infer_tune import contenthash

    fmt = check_format(fmt)
    info = build_info() if info is None else info
    folder = gguf_dir(checkpoint, info)
    target = folder / f"{fmt}.gguf"
    if target.is_file():
        return target
    folder.mkdir(parents=True, exist_ok=True)
    # the f16 conversion is about the checkpoint's size (bf16 / f16); a quantized format writes at most about 0.6
    # of it (q8_0: 8.5 bits a weight), after the f16 if that is still to be made
    checkpoint_bytes = _checkpoint_bytes(Path(checkpoint))
    f16_needed = fmt == "f16" or not (folder / "f16.gguf").is_file()
    need = (checkpoint_bytes if f16_needed else 0) + (0 if fmt == "f16" else checkpoint_bytes * 6 // 10)
    atomic.check_free_space(folder, need + (64 << 20), f"the GGUF {target.name}")
    staged = folder / f".{fmt}.gguf.partial-{os.getpid()}"
    try:
        if fmt == "f16":
            cmd = [sys.executable, str(source_dir(info) / "convert_hf_to_gguf.py"), str(checkpoint),
                   "--outtype", "f16", "--outfile", str(staged)]
            _run(cmd, f"convert_hf_to_gguf.py on {checkpoint}", timeout_s)
        else:
            f16 = gguf(checkpoint, "f16", threads=threads, info=info, timeout_s=timeout_s)
            cmd = [str(require("llama-quantize")), *head_flags(fmt), str(f16), str(staged), quant_type(fmt)] + \
                  ([str(threads)] if threads else [])
            _run(cmd, f"llama-quantize {quant_type(fmt)}", timeout_s)
        if not staged.is_file():
            raise LlamaCppError(f"{cmd[0]} wrote no file at {staged}")
        meta = {"format": fmt, "type": quant_type(fmt), "head": "q8_0" if head_flags(fmt) else "default",
                "checkpoint": str(checkpoint),
                "checkpoint_sha256": contenthash.tree_digest(Path(checkpoint)), "llama_cpp": _version_facts(info),
                "command": [Path(c).name if i == 0 else c for i, c in enumerate(cmd)],
                "bytes": staged.stat().st_size}
        atomic.write_json(folder / f"{fmt}.json", meta)
        staged.replace(target)  # another process making the same file: either finished copy is the same
    finally:
        staged.unlink(missing_ok=True)
    return target


def _checkpoint_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.glob("*.safetensors")) or 1 << 30


def gguf_facts(path: str | Path) -> dict:
    """The `.json` beside a GGUF this module made ({} for any other file)."""
    try:
        return json.loads(Path(path).with_suffix(".json").read_text())
    except (OSError, ValueError):
        return {}


def _version_facts(info: dict) -> dict:
    keys = ("commit", "build_number", "source_package", "llama_cpp_python", "system_info", "flags")
    return {k: info.get(k) for k in keys if info.get(k) is not None}


# --------------------------------------------------------------------------- the fastest format
def prompt_lengths(token_counts, most: int = 3) -> list[int]:
    """The workload's prompt lengths as llama-bench `-p` values: every distinct length, or when there are
    more than `most`, the shortest, the median and the longest (`most` = 3)."""
    values = sorted({int(n) for n in token_counts if int(n) > 0})
    if not values:
        raise ConfigError("no prompt lengths to time llama.cpp at")
    if len(values) <= most:
        return values
    picks = {values[0], values[len(values) // 2], values[-1]}
    return sorted(picks)


def bench_command(ggufs: list[Path], lengths: list[int], n_gen: int, threads: int, repeats: int) -> list[str]:
    cmd = [str(require("llama-bench"))]
    for path in ggufs:
        cmd += ["-m", str(path)]
    return cmd + ["-p", ",".join(str(n) for n in lengths), "-n", str(n_gen), "-t", str(threads),
                  "-r", str(repeats), "-o", "json"]


@dataclass
class FormatTiming:
    """One GGUF's llama-bench figures: decode tok/s over `n_gen` tokens and prefill ms per prompt length."""

    format: str
    gguf: str
    bytes: int | None
    decode_tok_s: float | None
    decode_stddev_tok_s: float | None
    prefill_ms: dict[int, float] = field(default_factory=dict)
    prefill_stddev_ms: dict[int, float] = field(default_factory=dict)

    def e2e_ms(self, n_gen: int) -> float | None:
        """Mean over the prompt lengths of prefill + `n_gen` decode steps (ms)."""
        if not self.decode_tok_s or not self.prefill_ms:
            return None
        prefill = sum(self.prefill_ms.values()) / len(self.prefill_ms)
        return prefill + n_gen * 1000.0 / self.decode_tok_s

    def score(self, objective: str, n_gen: int) -> float | None:
        """Lower is faster."""
        if objective == "decode":
            return -self.decode_tok_s if self.decode_tok_s else None
        if objective == "prefill":
            return sum(self.prefill_ms.values()) / len(self.prefill_ms) if self.prefill_ms else None
        return self.e2e_ms(n_gen)

    def to_dict(self, n_gen: int) -> dict:
        return {"format": self.format, "gguf": self.gguf, "bytes": self.bytes, "decode_tok_s": self.decode_tok_s,
                "decode_stddev_tok_s": self.decode_stddev_tok_s,
                "prefill_ms": {str(k): v for k, v in sorted(self.prefill_ms.items())},
                "prefill_stddev_ms": {str(k): v for k, v in sorted(self.prefill_stddev_ms.items())},
                "e2e_ms": self.e2e_ms(n_gen)}


def parse_bench(text: str, formats: dict[str, str]) -> tuple[list[FormatTiming], dict]:
    """llama-bench `-o json` output -> one FormatTiming per model file (in `formats`: path -> format name)
    and the build facts it reports (commit, build number, cpu_info, backends)."""
    try:
        rows = json.loads(text)
    except ValueError as exc:
        raise LlamaCppError(f"llama-bench printed no JSON: {exc}") from None
    if not isinstance(rows, list) or not rows:
        raise LlamaCppError("llama-bench reported no tests")
    by_file: dict[str, FormatTiming] = {}
    names = {Path(p).resolve().as_posix(): f for p, f in formats.items()}
    facts: dict = {}
    for row in rows:
        path = Path(str(row.get("model_filename", ""))).resolve().as_posix()
        if path not in names:
            raise LlamaCppError(f"llama-bench timed a model it was not given: {row.get('model_filename')}")
        for key in ("build_commit", "build_number", "cpu_info", "backends", "n_threads", "flash_attn", "n_batch",
                    "n_ubatch", "type_k", "type_v"):
            if key in row:
                facts.setdefault(key, row[key])
        timing = by_file.setdefault(path, FormatTiming(format=names[path], gguf=str(row.get("model_filename")),
                                                       bytes=row.get("model_size"), decode_tok_s=None,
                                                       decode_stddev_tok_s=None))
        n_prompt, n_gen = int(row.get("n_prompt", 0)), int(row.get("n_gen", 0))
        if n_gen > 0 and n_prompt == 0:
            timing.decode_tok_s = float(row["avg_ts"])
            timing.decode_stddev_tok_s = float(row.get("stddev_ts", 0.0))
        elif n_prompt > 0 and n_gen == 0:
            timing.prefill_ms[n_prompt] = float(row["avg_ns"]) / 1e6
            timing.prefill_stddev_ms[n_prompt] = float(row.get("stddev_ns", 0)) / 1e6
    return [by_file[p] for p in names if p in by_file], facts


def fastest(timings: list[FormatTiming], objective: str = "e2e", n_gen: int = 128) -> FormatTiming:
    """The fastest format by `objective` (module docstring); ties go to the smaller file."""
    if objective not in OBJECTIVES:
        raise ConfigError(f"objective must be one of {', '.join(OBJECTIVES)}, got {objective!r}")
    scored = [(t.score(objective, n_gen), t.bytes or 0, t) for t in timings]
    scored = [s for s in scored if s[0] is not None]
    if not scored:
        raise LlamaCppError(f"llama-bench gave no {objective} figure for any format")
    return min(scored, key=lambda s: (s[0], s[1]))[2]


@dataclass
class Best:
    """The reference format of this host, and how it was chosen."""

    format: str
    gguf: Path
    objective: str
    n_gen: int
    prompt_lengths: list[int]
    threads: int
    repeats: int
    timings: list[FormatTiming]
    llama_cpp: dict
    command: list[str]
    measured_s: float

    def timing(self) -> FormatTiming:
        return next(t for t in self.timings if t.format == self.format)

    def to_dict(self) -> dict:
        return {"format": self.format, "gguf": str(self.gguf), "objective": self.objective, "n_gen": self.n_gen,
                "prompt_lengths": self.prompt_lengths, "threads": self.threads, "repeats": self.repeats,
                "llama_cpp": self.llama_cpp, "command": self.command, "measured_s": self.measured_s,
                "formats": {t.format: t.to_dict(self.n_gen) for t in self.timings}}


def best(checkpoint: str | Path, lengths: list[int], n_gen: int, threads: int, *, repeats: int = 3,
         formats=BEST_FORMATS, objective: str = "e2e", extra: dict[str, Path] | None = None,
         progress=None) -> Best:
    """Make the checkpoint's GGUFs in `formats` (cached), time them all in one llama-bench call and pick the
    fastest. `extra`: more GGUFs timed in the same call, for the record (the shipped Q4_1), never chosen."""
    if n_gen < 1 or threads < 1 or repeats < 1:
        raise ConfigError("n_gen, threads and repeats must be >= 1")
    info = build_info()
    made = {}
    for fmt in formats:
        if progress:
            progress(f"GGUF {fmt}")
        made[str(gguf(checkpoint, fmt, threads=threads, info=info))] = check_format(fmt)
    timed = dict(made, **{str(p): name for name, p in (extra or {}).items()})
    cmd = bench_command([Path(p) for p in timed], lengths, n_gen, threads, repeats)
    if progress:
        progress(f"llama-bench {len(timed)} GGUFs")
    started = time.monotonic()
    out = _run(cmd, "llama-bench", timeout_s=3600.0)
    timings, facts = parse_bench(out, timed)
    chosen = fastest([t for t in timings if t.format in made.values()], objective, n_gen)
    llama_cpp = {**_version_facts(info), **{k: v for k, v in facts.items()}}
    return Best(format=chosen.format, gguf=Path(chosen.gguf), objective=objective, n_gen=n_gen,
                prompt_lengths=list(lengths), threads=threads, repeats=repeats, timings=timings,
                llama_cpp=llama_cpp, command=[Path(cmd[0]).name] + cmd[1:],
                measured_s=round(time.monotonic() - started, 3))


def reference_gguf(model_ref: str, choice: str, lengths: list[int], n_gen: int, threads: int, *,
                   repeats: int = 3, progress=None) -> tuple[Path, Best | None]:
    """The GGUF a llama.cpp reference serves, for the bench/ scripts' `--gguf`: `best` (the fastest of
    BEST_FORMATS by `best`, with the record), `shipped` (the GGUF a built-in model ships in, SmolLM2's Q4_1),
    a format name (made, not timed), or a .gguf path."""
    from infer_tune import models

    if choice == "shipped":
        return models.builtin_gguf(model_ref) if model_ref in models.BUILTINS else Path(model_ref), None
    if choice.lower().removesuffix(DEFAULT_HEAD) in QUANT_TYPES:
        return gguf(models.resolve(model_ref), choice, threads=threads), None
    if choice == "best":
        extra = {f"{model_ref} (shipped)": models.builtin_gguf(model_ref)} if model_ref in models.BUILTINS else {}
        chosen = best(models.resolve(model_ref), lengths, n_gen, threads, repeats=repeats, extra=extra,
                      progress=progress)
        return chosen.gguf, chosen
    path = Path(choice).expanduser()
    if path.suffix.lower() != ".gguf" or not path.is_file():
        raise ConfigError(f"--gguf must be best, shipped, one of {', '.join(QUANT_TYPES)} or a .gguf file; "
                          f"got {choice!r}")
    return path, None


def describe(path: Path, chosen: Best | None) -> str:
    """One line for a bench script's output: which GGUF, why, and the build."""
    info = build_info()
    build = f"llama.cpp {info.get('commit')} (build {info.get('build_number')})"
    if chosen is None:
        made = gguf_facts(path)
        return f"{build}, GGUF {path.name} ({made.get('format', 'given')}), {path}"
    per = "; ".join(f"{t.format} {t.decode_tok_s or 0:.1f} tok/s, "
                    + ", ".join(f"pp{n} {ms:.1f} ms" for n, ms in sorted(t.prefill_ms.items()))
                    for t in chosen.timings)
    return (f"{build}, fastest format here {chosen.format} ({chosen.objective}, llama-bench -r {chosen.repeats}: "
            f"{per}), {path}")
