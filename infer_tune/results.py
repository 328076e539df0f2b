"""Result documents: one JSON record per (model, config, workload) run, written atomically.

`runs/<run-id>/result.json` + `outputs.jsonl`. `compare`, `leaderboard` and CI read only these files.
A run folder is never replaced: run ids carry 32 random bits and a collision is detected when the
folder is moved into place (then the run gets a new id). Writers of one runs directory take its lock
(`runs_lock`), so concurrent sweeps queue instead of measuring the same baseline twice; reading
checks the schema and the types `compare` and `leaderboard` rely on.
"""

from __future__ import annotations

import errno
import hashlib
import json
import math
import os
import re
import secrets
import stat
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from infer_tune import atomic, jsonsafe
from infer_tune.document import SCHEMA_VERSION, ResultDocument
from infer_tune.errors import ResultError

REQUIRED_KEYS = ("schema_version", "run_id", "created_at", "tool", "env", "model", "technique", "config",
                 "workload", "metrics", "samples")
DISTRIBUTION_METRICS = ("ttft_ms", "itl_ms", "tpot_ms", "e2e_ms")


def new_run_id(technique: str, label: str) -> str:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    slug = "".join(c if c.isalnum() or c in "-." else "-" for c in label.lower()).strip("-")[:40]
    return f"{stamp}-{technique}-{slug}-{secrets.token_hex(4)}" if slug else f"{stamp}-{technique}-{secrets.token_hex(4)}"


RUN_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+-]{0,199}")  # what new_run_id makes; never a path
FILE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+-]{0,199}")  # a file saved in a run folder: a plain name


def check_run_id(run_id: object, where: str = "run id") -> str:
    """`run_id` when it is a plain run id (RUN_ID: letters, digits, `._+-`, no separator, no leading dot),
    checked before any path is joined with it; ResultError otherwise."""
    if not isinstance(run_id, str) or not RUN_ID.fullmatch(run_id):
        raise ResultError(f"{where} {str(run_id)[:80]!r} is not a run id (letters, digits and ._+- only)")
    return run_id


def fingerprint(*parts: Any) -> str:
    """Stable hash of what makes two runs the same measurement (used by --resume and baseline reuse)."""
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:16]


@dataclass
class SavedRun:
    run_dir: Path
    result: ResultDocument


def save_run(out_dir: Path, result: ResultDocument | dict, outputs: list[dict],
             extra_files: dict[str, bytes] | None = None) -> SavedRun:
    """Write `out_dir/<run_id>/` atomically: a staged folder moved into place when complete, never over
    an existing run (on a collision the result gets a fresh run id). Returns the saved document, typed,
    with its `location` (the document given is that object when it was a ResultDocument), frozen."""
    doc = result if isinstance(result, ResultDocument) else ResultDocument.from_dict(result)
    if doc.frozen:  # already saved: saving it again would be a second result of the same run
        raise ResultError(f"result {doc.run_id!r} is already saved ({doc.location})")
    for name in extra_files or {}:
        if CONCLUSION.fullmatch(str(name)):
            raise ResultError(f"file name {name!r} of run {str(doc.run_id)[:80]!r} is a sweep conclusion's name")
        if not FILE_NAME.fullmatch(str(name)):
            raise ResultError(f"file name {str(name)[:80]!r} of run {str(doc.run_id)[:80]!r} is not a "
                              "plain file name")
    for _ in range(8):
        final = Path(out_dir) / check_run_id(doc.run_id)
        try:
            with atomic.staged_dir(final, exists="error") as staging:
                atomic.write_json(staging / "result.json", doc.to_dict())
                atomic.write_text(staging / "outputs.jsonl",
                                  "".join(json.dumps(o, ensure_ascii=False) + "\n" for o in outputs))
                for name, data in (extra_files or {}).items():
                    atomic.write_bytes(staging / name, data)
        except FileExistsError:
            doc.run_id = new_run_id(str(doc.technique or "run"), str(doc.label or ""))
            continue
        doc.location = final
        doc.freeze()  # a saved result is never modified (its sweep's conclusion is saved beside it)
        return SavedRun(run_dir=final, result=doc)
    raise OSError(errno.EEXIST, f"could not find a free run id in {out_dir}")


# --------------------------------------------------------------------------- the runs-directory lock
LOCK_NAME = ".infer-tune.lock"
_locks: dict[str, threading.RLock] = {}
_depth: dict[str, int] = {}
_fds: dict[str, int] = {}
_guard = threading.Lock()


def _folder(doc: ResultDocument) -> Path:
    if not isinstance(doc, ResultDocument) or doc.location is None:
        raise ValueError(f"result {doc.get('run_id')!r} was not saved: it has no folder to write into")
    return Path(doc.location)


# what a sweep concluded over a saved row: `conclusion.json`, then `conclusion.2.json`... when concluded again
CONCLUSION = re.compile(r"conclusion(?:\.([1-9][0-9]{0,8}))?\.json")


def _conclusions(folder: Path) -> list[tuple[int, Path]]:
    """The conclusion files of a run folder as (version, path), oldest first."""
    found = []
    try:
        names = os.listdir(folder)
    except OSError:
        return []
    for name in names:
        if (m := CONCLUSION.fullmatch(name)):
            found.append((int(m.group(1) or 1), folder / name))
    return sorted(found)


def save_conclusion(doc: ResultDocument) -> Path | None:
    """Save what a sweep concluded over a saved row (`doc.conclusion`: the whole of it, from
    ResultDocument.with_conclusion) beside its result.json, never in it: a new file, written once,
    atomically (`conclusion.json`, then `conclusion.N.json` with the next N when the row is concluded again;
    the newest is read back by load_result). Nothing is written when the newest saved one says the same.
    The caller holds the runs directory's lock. Returns the file written, or None."""
    folder = _folder(doc)
    if not doc.conclusion:
        return None
    record = {"schema_version": SCHEMA_VERSION, "run_id": doc.run_id, **doc.conclusion}
    found = _conclusions(folder)
    if found and _read_conclusion(found[-1][1]) == record:
        return None
    version = found[-1][0] + 1 if found else 1
    file = folder / ("conclusion.json" if version == 1 else f"conclusion.{version}.json")
    if file.exists():
        raise ResultError(f"conclusion file {file} exists: a conclusion is never rewritten")
    atomic.write_json(file, record)
    return file


def _read_conclusion(file: Path) -> dict:
    data = _open_result(file)
    try:
        record = jsonsafe.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise ResultError(f"conclusion file {file} is not valid JSON: {str(exc).splitlines()[0][:200]}") from None
    if not isinstance(record, dict) or not isinstance(record.get("metrics", {}), dict) \
            or not isinstance(record.get("sections", {}), dict):
        raise ResultError(f"conclusion file {file} is not a conclusion (metrics and sections objects)")
    return record


def add_files(doc: ResultDocument, files: dict[str, bytes]) -> None:
    """Write `files` into a saved run's folder (`doc.location`), each atomically."""
    folder = _folder(doc)
    for name, data in files.items():
        atomic.write_bytes(folder / name, data)


@contextmanager
def runs_lock(out_dir: str | Path, on_wait: Callable[[], None] | None = None) -> Iterator[None]:
    """Hold the exclusive lock of a runs directory (an flock on OUT/.infer-tune.lock, released by the
    kernel if the process dies). Re-entrant in one thread; other threads and processes wait, after
    `on_wait()` is called once. On taking it, staging leftovers of killed runs are removed."""
    import fcntl

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    key = os.path.realpath(out)
    with _guard:
        lock = _locks.setdefault(key, threading.RLock())
    if not lock.acquire(blocking=False):
        if on_wait:
            on_wait()
        lock.acquire()
    try:
        if _depth.get(key, 0) == 0:
            fd = os.open(out / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o666 & ~atomic.umask())
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                if on_wait:
                    on_wait()
                fcntl.flock(fd, fcntl.LOCK_EX)
            except BaseException:
                os.close(fd)
                raise
            _fds[key] = fd
            atomic.clean_stale(out)
        _depth[key] = _depth.get(key, 0) + 1
        try:
            yield
        finally:
            _depth[key] -= 1
            if _depth[key] == 0:
                fd = _fds.pop(key)
                fcntl.flock(fd, fcntl.LOCK_UN)
                os.close(fd)
    finally:
        lock.release()


# --------------------------------------------------------------------------- reading
MAX_RESULT_BYTES = 64 << 20  # a result.json larger than this is refused by its size, before it is read
MAX_OUTPUTS_BYTES = 256 << 20
MAX_MS = 1e8  # about 28 hours: a timing above it is not a measurement of one request
MIN_MS = 1e-6  # one nanosecond, the clocks' resolution: a timing above 0 and below it was not measured
MIN_REQUEST_MS = 1e-3  # one microsecond: no request gets its first (or last) token sooner
KNOWN_VERDICTS = ("held", "did not hold here", "did not hold", "not applicable", "inconclusive")
TIMING_SAMPLES = ("ttft_ms", "tpot_ms", "e2e_ms", "itl_ms", "queue_ms")
POSITIVE_SAMPLES = ("ttft_ms", "e2e_ms")  # a request cannot get its first (or last) token in zero time
STATS = ("p50", "p90", "p99", "mean", "stdev", "mad")
_warned: set[str] = set()
_warn: Callable[[str], None] | None = None


def set_warning_handler(handler: Callable[[str], None] | None) -> None:
    """Where `find_results` reports a skipped file when its caller did not ask for the list (the CLI
    installs its `warning:` printer; each file is reported once per process)."""
    global _warn
    _warn = handler


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _type(value: Any) -> str:
    return type(value).__name__


def _timing_problem(where: str, value: Any, least: float = MIN_MS) -> str | None:
    """A timing in ms: finite, not negative, at most MAX_MS, and 0 or at least `least` (a sub-nanosecond
    timing made `compare` pass its gate at -100%)."""
    if not _number(value) or not math.isfinite(value):
        return f"'{where}' is {value!r}, expected a finite number"
    if value < 0:
        return f"'{where}' is negative ({value:g} ms)"
    if value > MAX_MS:
        return f"'{where}' is {value:g} ms, beyond any request ({MAX_MS:g} ms)"
    if 0 < value < least:
        return f"'{where}' is {value:g} ms, below what a clock measures ({least:g} ms)"
    return None


def _distribution_problem(key: str, block: Any) -> str | None:
    """A summary block (metrics.summarize's shape): finite, non-negative, ordered statistics."""
    if not isinstance(block, dict):
        return f"'metrics.{key}' is {_type(block)}, expected an object of statistics"
    n = block.get("n")
    if n is not None and (not isinstance(n, int) or isinstance(n, bool) or n < 0):
        return f"'metrics.{key}.n' is {n!r}, expected a count"
    for name, value in block.items():
        if name in ("n", "p50_ci95") or value is None:
            continue
        if not _number(value):
            return f"'metrics.{key}.{name}' is {_type(value)}, expected a number"
        least = MIN_REQUEST_MS if key in POSITIVE_SAMPLES and name in ("p50", "p90", "p99", "mean") else MIN_MS
        if name in ("stdev", "mad"):
            least = 0.0  # a spread may be as small as rounding makes it
        if name in STATS and (problem := _timing_problem(f"metrics.{key}.{name}", value, least)):
            return problem
    ci = block.get("p50_ci95")
    if ci is not None and not (isinstance(ci, list) and len(ci) == 2 and all(_number(v) and math.isfinite(v)
                                                                           for v in ci)):
        return f"'metrics.{key}.p50_ci95' must be two finite numbers"
    ordered = [block.get(s) for s in ("p50", "p90", "p99")]
    if all(_number(v) for v in ordered) and not ordered[0] <= ordered[1] * (1 + 1e-9) <= ordered[2] * (1 + 1e-9):
        return f"'metrics.{key}' has p50 > p90 or p90 > p99"
    if key in POSITIVE_SAMPLES and _number(block.get("p50")) and block["p50"] <= 0 and (n or 0) > 0:
        return f"'metrics.{key}.p50' is {block['p50']:g}: a request takes time"
    return None


MAX_VALUE = 1e18  # a metric beyond this (bytes, tokens, FLOPs included) is not a measurement
MAX_RATIO = 1e6  # a speedup or ratio against the baseline beyond this (or at or below 0) is not one
RATIO_METRICS = ("speedup_vs_baseline", "ttft_speedup_vs_baseline", "throughput_ratio_vs_baseline")
# ratios that may be exactly 0: a candidate that produced no token at all has 0 of the baseline's throughput
ZERO_RATIOS = ("throughput_ratio_vs_baseline",)


def _ratio_ok(key: str, value: float) -> bool:
    return (0 <= value if key in ZERO_RATIOS else 0 < value) and value <= MAX_RATIO
# metrics the reports read as numbers (leaderboard columns, recommendation budget, claims): a string there is refused
NUMERIC_METRICS = RATIO_METRICS + (
    "output_throughput_tok_s", "request_throughput_req_s", "peak_rss_bytes", "model_bytes", "bleu", "chrf", "ppl",
    "bleu_drift", "bleu_vs_baseline", "exact_match_vs_baseline", "ppl_delta_pct", "pass_at_1", "roofline_fraction",
    "roofline_tok_s", "output_mismatches", "first_divergence_token", "requests_failed", "requests_ok", "iterations")


def _values_problem(metrics: dict) -> str | None:
    """Every number among the metrics finite and within MAX_VALUE; the metrics reports read as numbers
    numbers (or null); ratios against the baseline above 0 and at most MAX_RATIO, their intervals too."""
    for key, value in metrics.items():
        if value is None:
            continue
        if key in NUMERIC_METRICS and not _number(value):
            return f"'metrics.{key}' is {_type(value)} {str(value)[:40]!r}, expected a number"
        if _number(value) and not (math.isfinite(value) and abs(value) <= MAX_VALUE):
            return f"'metrics.{key}' is {value!r}, expected a finite number within ±{MAX_VALUE:g}"
        if key in RATIO_METRICS and not _ratio_ok(key, value):
            return f"'metrics.{key}' is {value!r}, expected a ratio above 0 and at most {MAX_RATIO:g}"
        if key.endswith("_ci95") and key[:-5] in NUMERIC_METRICS:
            if not (isinstance(value, list) and len(value) == 2 and all(_number(v) and math.isfinite(v)
                                                                        and abs(v) <= MAX_VALUE for v in value)):
                return f"'metrics.{key}' must be two finite numbers"
            if key[:-5] in RATIO_METRICS and not all(_ratio_ok(key[:-5], v) for v in value):
                return f"'metrics.{key}' is {value!r}, expected ratios above 0 and at most {MAX_RATIO:g}"
    return None


def _samples_problem(samples: dict) -> str | None:
    """Raw samples: lists of finite, non-negative, bounded timings; ttft/e2e positive (tpot/itl may be 0:
    tokens that arrive in one network read share a timestamp); per-request lists of equal length; e2e never
    before ttft."""
    for key, values in samples.items():
        if values is None:
            continue
        if not isinstance(values, list):
            return f"'samples.{key}' is {_type(values)}, expected a list of numbers"
        if key == "prompt_index":
            if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in values):
                return "'samples.prompt_index' must hold integers >= 0"
            continue
        if not all(_number(v) and math.isfinite(v) for v in values):
            return f"'samples.{key}' must hold finite numbers"
        if key not in TIMING_SAMPLES:
            continue
        least = MIN_REQUEST_MS if key in POSITIVE_SAMPLES else MIN_MS
        for value in values:
            if problem := _timing_problem(f"samples.{key}", value, least):
                return problem
        if key in POSITIVE_SAMPLES and any(v <= 0 for v in values):
            return f"'samples.{key}' holds a zero: a request takes time"
    per_request = [k for k in ("ttft_ms", "e2e_ms", "prompt_index", "queue_ms") if isinstance(samples.get(k), list)]
    lengths = {k: len(samples[k]) for k in per_request}
    if len(set(lengths.values())) > 1:
        return "samples per request differ in length: " + ", ".join(f"{k} {n}" for k, n in lengths.items())
    if isinstance(samples.get("tpot_ms"), list) and "ttft_ms" in lengths and len(samples["tpot_ms"]) > lengths["ttft_ms"]:
        return "'samples.tpot_ms' has more values than requests"
    if "ttft_ms" in lengths and "e2e_ms" in lengths and any(
            e < t * (1 - 1e-9) for t, e in zip(samples["ttft_ms"], samples["e2e_ms"])):
        return "'samples.e2e_ms' ends before its request's first token"
    return None


def _claim_problem(where: str, claim: Any) -> str | None:
    """A claim check in a shape the claims table reads (report/claims.py; docs/architecture.md, Claims)."""
    if not isinstance(claim, dict):
        return f"'{where}' is {_type(claim)}, expected an object"
    for key in ("held", "size_held", "speed_held", "quality_held", "wall_held", "ttft_held"):
        if key in claim and claim[key] is not None and not isinstance(claim[key], bool):
            return f"'{where}.{key}' is {claim[key]!r}, expected true, false or null"
    verdict = claim.get("verdict")
    if verdict is not None and verdict not in KNOWN_VERDICTS:
        return f"'{where}.verdict' is {str(verdict)[:40]!r}, expected one of: {', '.join(KNOWN_VERDICTS)}"
    for key in ("claim", "statement", "finding", "why", "method"):
        if claim.get(key) is not None and not isinstance(claim[key], str):
            return f"'{where}.{key}' is {_type(claim[key])}, expected text"
    if not (claim.get("claim") or claim.get("statement")):
        return f"'{where}' states no claim (claim or statement)"
    numbers = ["value", "bytes_ratio_vs_16bit", "speedup_judged", "ppl_delta_pct", "bleu_drift"]
    required: list[str] = []
    if claim.get("claim") == "compute_saved_at_500_tokens":
        required = ["new_tokens", "prompt_tokens", "flops_saved_fraction"]
        if "wall_saved_fraction" in claim:
            required += ["wall_saved_fraction", "measured_new_tokens"]
    elif claim.get("claim") == "kv_bytes_at_long_context":
        required = ["kv_bytes_16bit", "context_tokens"]
    for key in required:
        if not _number(claim.get(key)) or not math.isfinite(claim[key]):
            return f"'{where}.{key}' is {claim.get(key)!r}, expected a finite number"
    for key in numbers:
        if claim.get(key) is not None and (not _number(claim[key]) or not math.isfinite(claim[key])):
            return f"'{where}.{key}' is {claim[key]!r}, expected a finite number or null"
    interval = claim.get("interval")
    if interval is not None and not (isinstance(interval, list) and len(interval) == 2
                                     and all(_number(v) and math.isfinite(v) for v in interval)):
        return f"'{where}.interval' must be two finite numbers"
    return None


def _noise_problem(noise: Any) -> str | None:
    if not isinstance(noise, dict):
        return f"'metrics.noise' is {_type(noise)}, expected an object"
    if noise.get("noisy") is not None and not isinstance(noise["noisy"], bool):
        return f"'metrics.noise.noisy' is {noise['noisy']!r}, expected true or false"
    why = noise.get("why")
    if why is not None and not (isinstance(why, list) and all(isinstance(w, str) for w in why)):
        return "'metrics.noise.why' must be a list of text"
    for key, value in noise.items():
        if key not in ("noisy", "why") and value is not None and (not _number(value) or not math.isfinite(value)
                                                                  or value < 0):
            return f"'metrics.noise.{key}' is {value!r}, expected a finite number >= 0"
    return None


def validate(doc: Any) -> str | None:
    """What is wrong with a result document (None when every reader can trust it): schema version,
    required keys, block types, timings (finite, non-negative, bounded, the right shape), claim checks
    (known verdicts, the fields the claims table reads) and the noise figure."""
    if isinstance(doc, ResultDocument):
        doc = doc.to_dict()
    if not isinstance(doc, dict):
        return "does not hold a result object"
    version = doc.get("schema_version")
    if version != SCHEMA_VERSION or isinstance(version, bool):
        return f"has schema_version {version!r}; this infer-tune reads {SCHEMA_VERSION}"
    missing = [k for k in REQUIRED_KEYS if k not in doc]
    if missing:
        return f"lacks keys: {', '.join(missing)}"
    problem = _schema_problem(doc)
    return f"is malformed: {problem}" if problem else None


def _schema_problem(doc: dict) -> str | None:
    """What is wrong with a document's types and values (None when `compare` and `leaderboard` can read it)."""
    for key, kind in (("run_id", str), ("created_at", str), ("technique", str), ("tool", dict), ("env", dict),
                      ("model", dict), ("config", dict), ("workload", dict), ("metrics", dict), ("samples", dict)):
        if not isinstance(doc[key], kind):
            return f"'{key}' is {_type(doc[key])}, expected {kind.__name__}"
    if not doc["run_id"] or "/" in doc["run_id"] or "\\" in doc["run_id"] or doc["run_id"] in (".", ".."):
        return f"'run_id' {doc['run_id'][:80]!r} is not a run id"
    for key, kind in (("label", str), ("protocol", dict), ("baseline_run_id", str), ("fingerprint", str),
                      ("runner", str), ("claims", (list, dict)), ("engine", str), ("engine_version", dict),
                      ("engine_argv", list)):
        if doc.get(key) is not None and not isinstance(doc[key], kind):
            return f"'{key}' is {_type(doc[key])}, expected {getattr(kind, '__name__', 'a list or object')}"
    metrics = doc["metrics"]
    for key in DISTRIBUTION_METRICS + ("queue_ms",):
        if metrics.get(key) is not None and (problem := _distribution_problem(key, metrics[key])):
            return problem
    for key in ("output_throughput_tok_s", "request_throughput_req_s"):
        value = metrics.get(key)
        if value is not None and (not _number(value) or value < 0 or math.isinf(value)):
            return f"'metrics.{key}' is {value!r}, expected a finite number >= 0"
    if (problem := _values_problem(metrics)):
        return problem
    if (problem := _samples_problem(doc["samples"])):
        return problem
    for where, source in (("metrics.claim_check", metrics.get("claim_check")), ("metrics.claims", metrics.get("claims")),
                          ("claims", doc.get("claims"))):
        if source is None:
            continue
        items = source if isinstance(source, list) else [source]
        for k, claim in enumerate(items):
            if (problem := _claim_problem(where if len(items) == 1 else f"{where}[{k}]", claim)):
                return problem
    if metrics.get("noise") is not None:
        return _noise_problem(metrics["noise"])
    return None


def _open_result(file: Path) -> bytes:
    """The bytes of a result file: a regular file, not a symlink, at most MAX_RESULT_BYTES (checked on the
    open descriptor before reading, so a huge file costs nothing)."""
    try:
        fd = os.open(file, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0))
    except PermissionError:
        raise ResultError(f"result file {file} is not readable (permission denied)") from None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise ResultError(f"result file {file} is a symbolic link; results are read only from their own "
                              "folder") from None
        raise ResultError(f"result file {file} cannot be read: {exc.strerror}") from None
    with os.fdopen(fd, "rb") as handle:
        info = os.fstat(handle.fileno())
        if not stat.S_ISREG(info.st_mode):
            raise ResultError(f"result file {file} is not a regular file")
        if info.st_size > MAX_RESULT_BYTES:
            raise ResultError(f"result file {file} is {info.st_size / 2**20:.0f} MiB, over the "
                              f"{MAX_RESULT_BYTES >> 20} MiB a result may take")
        data = handle.read(MAX_RESULT_BYTES + 1)
    if len(data) > MAX_RESULT_BYTES:
        raise ResultError(f"result file {file} grew over {MAX_RESULT_BYTES >> 20} MiB while being read")
    return data


def load_result(path: str | Path, *, drop: tuple[str, ...] = ()) -> ResultDocument:
    """Read one result (a run folder or its result.json) with its sweep's newest conclusion merged in
    (`save_conclusion`), and validate it (`validate`); ResultError with one line otherwise. Its `location` is
    the real folder the file lies in, whatever the document says. It is frozen (never modified); `drop`:
    bulky top-level parts left out as it is read (ResultDocument.from_dict)."""
    path = Path(path).expanduser()
    file = path / "result.json" if path.is_dir() else path
    if not file.is_file() and not file.is_symlink():
        raise ResultError(f"result not found: {path} (give a run folder or its result.json)")
    data = _open_result(file)
    try:
        doc = jsonsafe.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        detail = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise ResultError(f"result file {file} is not valid JSON: {detail}") from None
    problem = validate(doc)
    if problem:
        raise ResultError(f"result file {file} {problem}")
    folder = os.path.realpath(file.parent)
    out = ResultDocument.from_dict(doc, location=folder, drop=drop)
    if file.name == "result.json" and (found := _conclusions(Path(folder))):
        record = _read_conclusion(found[-1][1])
        if record.get("run_id") not in (None, out.run_id):
            raise ResultError(f"conclusion file {found[-1][1]} is about run {str(record.get('run_id'))[:80]!r}")
        try:
            out = out.with_conclusion(record.get("metrics"), record.get("sections"),
                                      source=f"conclusion file {found[-1][1]}", check=False)
        except (KeyError, ValueError) as exc:
            raise ResultError(f"conclusion file {found[-1][1]} is malformed: {exc}") from None
        if (problem := validate(out)):
            raise ResultError(f"result file {file} with its conclusion {found[-1][1]} {problem}")
    out.freeze()
    return out


def created_stamp() -> str:
    """`created_at` of a new result: local time to the millisecond, so rows saved within one second keep
    their order (find_results sorts on it)."""
    now = time.time()
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(now)) + f".{int(now * 1000) % 1000:03d}" \
        + time.strftime("%z", time.localtime(now))


def _result_files(root: Path, skipped: list[tuple[str, str]]) -> Iterator[Path]:
    """Every `result.json` under `root` through real folders only: symlinked folders are not entered,
    symlinked result files are skipped (and named), hidden (staging) folders are passed over."""
    stack = [root]
    while stack:
        folder = stack.pop()
        try:
            entries = sorted(os.scandir(folder), key=lambda e: e.name)
        except OSError:
            continue
        folders = []
        for entry in entries:
            if entry.name.startswith("."):
                continue  # staging folders of runs still in progress
            if entry.name == "result.json":
                if entry.is_symlink():
                    skipped.append((entry.path, f"result file {entry.path} is a symbolic link"))
                elif entry.is_file(follow_symlinks=False):
                    yield Path(entry.path)
            elif entry.is_dir(follow_symlinks=False):
                folders.append(Path(entry.path))
        stack.extend(reversed(folders))  # popped in name order


def find_results(runs_dir: str | Path, skipped: list[tuple[str, str]] | None = None, *,
                 drop: tuple[str, ...] = ()) -> list[ResultDocument]:
    """Every valid result under `runs_dir` (one level of run folders, or nested), oldest first.

    Invalid ones are left out: pass a list as `skipped` to get (path, reason) for each of them; without
    it each is reported once through the warning handler (`set_warning_handler`). `drop`: top-level keys
    removed from each document as soon as it is validated (`leaderboard` keeps no `samples`: per-request
    lists are most of a result's size, so a large runs folder is held at a few KiB per row).
    """
    root = Path(runs_dir).expanduser()
    if not root.exists():
        raise ResultError(f"runs directory not found: {runs_dir}")
    if not root.is_dir():
        raise ResultError(f"{runs_dir} is a file, not a runs directory")
    bad: list[tuple[str, str]] = []
    docs = []
    for file in _result_files(root, bad):
        try:
            doc = load_result(file, drop=drop)
        except ResultError as exc:
            bad.append((str(file), str(exc)))
            continue
        docs.append(doc)
    if skipped is not None:
        skipped.extend(bad)
    elif _warn is not None:
        for path, reason in bad:
            if path not in _warned:
                _warned.add(path)
                _warn(f"skipped an invalid result: {reason}")
    return sorted(docs, key=lambda d: d.get("created_at", ""))


def load_outputs(run_dir: str | Path | ResultDocument) -> list[dict]:
    """The outputs rows of a run (its folder, or a saved document: its `location`; empty when it has none);
    ResultError when the file is corrupt."""
    if isinstance(run_dir, ResultDocument):
        run_dir = _folder(run_dir)
    file = Path(run_dir) / "outputs.jsonl"
    if not file.is_file() or file.is_symlink():
        return []
    try:
        if file.stat().st_size > MAX_OUTPUTS_BYTES:
            raise ResultError(f"outputs file {file} is over the {MAX_OUTPUTS_BYTES >> 20} MiB an outputs file may take")
        rows = [json.loads(line) for line in file.read_text(encoding="utf-8").splitlines() if line.strip()]
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ResultError(f"outputs file {file} is not valid JSON lines: {str(exc).splitlines()[0]}") from None
    if not all(isinstance(row, dict) for row in rows):
        raise ResultError(f"outputs file {file} holds rows that are not objects")
    return rows
