"""Workloads for the load generator beyond single-turn Poisson prompts (no network here: building and parsing).

- **Traces** (`read_trace`): Mooncake JSONL (`timestamp` ms, `input_length`, `output_length`, `hash_ids`:
  one id per `block_size`-token block of the prompt, default 512), BurstGPT CSV (`Timestamp` s, `Model`,
  `Request tokens`, `Response tokens`, `Total tokens`, `Log Type`) and a plain JSONL (`timestamp` ms,
  `prompt` or `input_length`, `output_length`). Timestamps must not decrease, lengths must be counts; a
  bad file is a `ConfigError` naming the line. `synthesize_trace` draws a longer trace with the same
  statistics (inter-arrival gaps and requests resampled, seeded), `write_trace` saves one.
- **Prompts of a given length** (`trace_prompts`): text made of words that are one token each (for the
  tokenizer given, else a fixed list), so `input_length` is the prompt's length in tokens (plus the chat
  template under the chat API). A Mooncake block's words are a seeded function of its hash id: requests
  that share a hash block share that block's text, so a prefix cache sees the trace's real sharing.
- **Shared prefixes** (`shared_prefix_requests`): N system prompts of L tokens, each request one of them
  (seeded) followed by a unique suite prompt.
- **Conversations** (`Conversation`, `plan_sessions`): whole ShareGPT conversations for multi-turn
  sessions: arrival of each session, think time before each later turn (seeded).
- **Per-turn aggregation** (`per_turn`): TTFT p50 / p90 by turn index and by history length.
"""

from __future__ import annotations

import csv
import json
import math
import random
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from infer_tune.errors import ConfigError

FORMATS = ("mooncake", "burstgpt", "jsonl")
WORKLOADS = ("poisson", "multi-turn", "shared-prefix", "trace")
HISTORY = ("server", "recorded")
DEFAULT_BLOCK_SIZE = 512
BURSTGPT_COLUMNS = ("Timestamp", "Model", "Request tokens", "Response tokens", "Total tokens", "Log Type")
MAX_TRACE_BYTES = 256 << 20  # a trace file larger than this is refused (read whole into memory)

# Common English words, each one token in the usual BPE / SentencePiece vocabularies (with a leading space).
WORDS = """the of and to in is for on that with as was at by it from be this are or an have not which you
one all were can but has had they more their will there when what been would about out up other into time
some only its new them these may people than first any over most also after two used could many such where
way well make through then those each very year years should being world because day before still back
while three same made own part life long work much under here both during found take know place later state
house city high small never water great own every since last number another little order show group point
school within end night story family music form line name word case power next left real book fact home
early land side light game body hand team open head war less line land area city field market road money
river color plan room food paper north south east west center table wind bird tree stone glass garden""".split()


@dataclass
class WorkloadOptions:
    """Which workload `endpoint sim` / `bench --endpoint` sends (`--workload`) and its knobs."""

    kind: str = "poisson"
    sessions: int = 8
    max_turns: int = 4
    min_turns: int = 1
    think_time_ms: float = 1000.0
    history: str = "server"
    prefixes: int = 4
    prefix_tokens: int = 256
    trace: str | None = None
    trace_format: str | None = None
    time_scale: float = 1.0
    block_size: int = DEFAULT_BLOCK_SIZE

    def __post_init__(self) -> None:
        if self.kind not in WORKLOADS:
            raise ConfigError(f"--workload must be one of {', '.join(WORKLOADS)}, got {self.kind!r}")
        if self.history not in HISTORY:
            raise ConfigError(f"--history must be one of {', '.join(HISTORY)}, got {self.history!r}")
        for flag, value in (("--sessions", self.sessions), ("--max-turns", self.max_turns), ("--min-turns", self.min_turns),
                            ("--prefixes", self.prefixes), ("--prefix-tokens", self.prefix_tokens),
                            ("--block-size", self.block_size)):
            if value < 1:
                raise ConfigError(f"{flag} must be >= 1, got {value}")
        if self.min_turns > self.max_turns:
            raise ConfigError(f"--min-turns ({self.min_turns}) must be <= --max-turns ({self.max_turns})")
        if not (self.think_time_ms >= 0 and math.isfinite(self.think_time_ms)):
            raise ConfigError(f"--think-time-ms must be a finite number >= 0, got {self.think_time_ms}")
        if not (self.time_scale > 0 and math.isfinite(self.time_scale)):
            raise ConfigError(f"--time-scale must be a finite number > 0, got {self.time_scale}")
        if self.kind == "trace":
            if not self.trace or not self.trace_format:
                raise ConfigError("--workload trace needs --trace FILE and --trace-format mooncake|burstgpt|jsonl")
            if self.trace_format not in FORMATS:
                raise ConfigError(f"--trace-format must be one of {', '.join(FORMATS)}, got {self.trace_format!r}")
        elif self.trace:
            raise ConfigError("--trace applies to --workload trace")

    def to_dict(self) -> dict:
        keys = {"poisson": (), "multi-turn": ("sessions", "max_turns", "think_time_ms", "history"),
                "shared-prefix": ("prefixes", "prefix_tokens"),
                "trace": ("trace", "trace_format", "time_scale", "block_size")}[self.kind]
        if self.kind == "multi-turn" and self.min_turns > 1:  # left out at its default: earlier results keep their key
            keys += ("min_turns",)
        return {"kind": self.kind, **{k: getattr(self, k) for k in keys}}


@dataclass
class TraceEntry:
    """One request of a timed trace: arrival (s after the first), lengths in tokens, its Mooncake hash
    blocks (empty: a unique prompt) or its prompt text as given (plain JSONL)."""

    arrival_s: float
    input_length: int
    output_length: int
    hash_ids: list[int] = field(default_factory=list)
    prompt: str | list[dict] | None = None


def _bad(path: Path, where: str, what: str) -> ConfigError:
    return ConfigError(f"trace {path.name} {where}: {what}")


def _count(path: Path, where: str, name: str, value, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value or math.isinf(value) \
            or int(value) != value:
        raise _bad(path, where, f"{name} must be a whole number, got {value!r}")
    if value < minimum:
        raise _bad(path, where, f"{name} must be >= {minimum}, got {value!r}")
    return int(value)


def _time(path: Path, where: str, name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise _bad(path, where, f"{name} must be a finite number, got {value!r}")
    if value < 0:
        raise _bad(path, where, f"{name} must be >= 0, got {value!r}")
    return float(value)


def _jsonl_rows(path: Path):
    with open(path, encoding="utf-8") as lines:
        for n, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise _bad(path, f"line {n}", f"not JSON ({exc.msg})") from None
            if not isinstance(row, dict):
                raise _bad(path, f"line {n}", "not a JSON object")
            yield n, row


def _need(path: Path, where: str, row: dict, keys: Sequence[str]) -> None:
    missing = [k for k in keys if k not in row]
    if missing:
        raise _bad(path, where, f"missing {', '.join(missing)} (has {', '.join(sorted(map(str, row))) or 'nothing'})")


def _messages(value) -> bool:
    return isinstance(value, list) and bool(value) and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in value)


def read_trace(path: str | Path, fmt: str, *, block_size: int = DEFAULT_BLOCK_SIZE) -> tuple[list[TraceEntry], dict]:
    """The requests of a trace file (arrivals relative to its first request) and what was read
    (`format`, `rows`, `skipped`: BurstGPT rows with 0 response tokens, failed requests of the log)."""
    path = Path(path).expanduser()
    if fmt not in FORMATS:
        raise ConfigError(f"--trace-format must be one of {', '.join(FORMATS)}, got {fmt!r}")
    if not path.is_file():
        raise ConfigError(f"trace file not found: {path}")
    if path.stat().st_size > MAX_TRACE_BYTES:
        raise ConfigError(f"trace {path.name} is over {MAX_TRACE_BYTES >> 20} MiB")
    if block_size < 1:
        raise ConfigError(f"--block-size must be >= 1, got {block_size}")
    stamps, entries, skipped = [], [], 0
    if fmt == "burstgpt":
        with open(path, encoding="utf-8", newline="") as handle:
            reader = csv.DictReader(handle)
            missing = [c for c in BURSTGPT_COLUMNS if c not in (reader.fieldnames or [])]
            if missing:
                raise _bad(path, "header", f"missing column(s) {', '.join(missing)} (BurstGPT has "
                                           f"{', '.join(BURSTGPT_COLUMNS)})")
            for n, row in enumerate(reader, 2):
                where = f"line {n}"
                try:
                    values = {c: float(row[c]) for c in ("Timestamp", "Request tokens", "Response tokens")}
                except (TypeError, ValueError):
                    raise _bad(path, where, "Timestamp, Request tokens and Response tokens must be numbers") from None
                t = _time(path, where, "Timestamp", values["Timestamp"])
                inp = _count(path, where, "Request tokens", values["Request tokens"], 0)
                out = _count(path, where, "Response tokens", values["Response tokens"], 0)
                stamps.append((where, t))
                if out == 0 or inp == 0:  # a failed request in the log: nothing to replay
                    skipped += 1
                    continue
                entries.append((t, TraceEntry(0.0, inp, out)))
    else:
        for n, row in _jsonl_rows(path):
            where = f"line {n}"
            if fmt == "mooncake":
                _need(path, where, row, ("timestamp", "input_length", "output_length", "hash_ids"))
                hashes = row["hash_ids"]
                if not isinstance(hashes, list) or not all(isinstance(h, int) and not isinstance(h, bool)
                                                           for h in hashes):
                    raise _bad(path, where, "hash_ids must be a list of integers")
                inp = _count(path, where, "input_length", row["input_length"], 1)
                if inp > len(hashes) * block_size:
                    raise _bad(path, where, f"input_length {inp} is longer than its {len(hashes)} hash block(s) of "
                                            f"{block_size} tokens (--block-size)")
                entry = TraceEntry(0.0, inp, _count(path, where, "output_length", row["output_length"], 1), hashes)
            else:
                _need(path, where, row, ("timestamp", "output_length"))
                if "prompt" not in row and "input_length" not in row:
                    raise _bad(path, where, "needs prompt or input_length")
                prompt = row.get("prompt")
                if prompt is not None and not (isinstance(prompt, str) and prompt or _messages(prompt)):
                    raise _bad(path, where, "prompt must be a non-empty string or a list of chat messages "
                                            "({role, content})")
                inp = _count(path, where, "input_length", row["input_length"], 1) if prompt is None else 0
                entry = TraceEntry(0.0, inp, _count(path, where, "output_length", row["output_length"], 1),
                                   prompt=prompt)
            t = _time(path, where, "timestamp", row["timestamp"]) / 1000.0
            stamps.append((where, t))
            entries.append((t, entry))
    for (_, before), (where, t) in zip(stamps, stamps[1:]):
        if t < before:
            raise _bad(path, where, f"timestamp goes back in time ({t:g} after {before:g}): timestamps must not "
                                    "decrease")
    if not entries:
        raise ConfigError(f"trace {path.name} has no request to replay")
    t0 = entries[0][0]
    for t, entry in entries:
        entry.arrival_s = t - t0
    return [e for _, e in entries], {"format": fmt, "file": path.name, "rows": len(stamps), "skipped": skipped,
                                     "block_size": block_size}


def scale_times(entries: list[TraceEntry], time_scale: float) -> list[TraceEntry]:
    """Arrivals multiplied by `time_scale` (0.5: the trace replayed twice as fast, 2: half as fast)."""
    if not (time_scale > 0 and math.isfinite(time_scale)):
        raise ConfigError(f"--time-scale must be a finite number > 0, got {time_scale}")
    return [TraceEntry(e.arrival_s * time_scale, e.input_length, e.output_length, list(e.hash_ids), e.prompt)
            for e in entries]


def synthesize_trace(entries: Sequence[TraceEntry], n: int, *, seed: int = 0) -> list[TraceEntry]:
    """`n` requests with the statistics of `entries`: each inter-arrival gap drawn from the trace's gaps,
    each request (lengths, hash blocks, prompt) drawn from its requests, with replacement, seeded. Requests
    that shared hash blocks in the source still share them, so the prefix-sharing pattern carries over."""
    if n < 1:
        raise ConfigError(f"a synthesized trace needs >= 1 request, got {n}")
    if not entries:
        raise ConfigError("cannot synthesize from an empty trace")
    rng = random.Random(seed)
    gaps = [b.arrival_s - a.arrival_s for a, b in zip(entries, entries[1:])] or [0.0]
    out, t = [], 0.0
    for k in range(n):
        if k:
            t += rng.choice(gaps)
        src = rng.choice(entries)
        out.append(TraceEntry(t, src.input_length, src.output_length, list(src.hash_ids), src.prompt))
    return out


def write_trace(entries: Sequence[TraceEntry], path: str | Path) -> None:
    """Save `entries` atomically as JSONL: Mooncake rows where requests have hash ids, else plain JSONL
    (`prompt` kept where a request had one)."""
    from infer_tune import atomic

    atomic.write_text(Path(path), trace_jsonl(entries))


def trace_jsonl(entries: Sequence[TraceEntry]) -> str:
    rows = []
    for e in entries:
        row = {"timestamp": round(e.arrival_s * 1000.0, 3), "input_length": e.input_length,
               "output_length": e.output_length}
        if e.hash_ids:  # Mooncake; without hash ids the file reads back as plain JSONL
            row["hash_ids"] = e.hash_ids
        if e.prompt is not None:
            row["prompt"] = e.prompt
        rows.append(json.dumps(row, ensure_ascii=False) + "\n")
    return "".join(rows)


def sharing_first_block(entries: Sequence[TraceEntry]) -> int:
    """Requests whose first hash block opens another request's prompt too (a prefix cache can reuse it)."""
    counts: dict[int, int] = {}
    for e in entries:
        if e.hash_ids:
            counts[e.hash_ids[0]] = counts.get(e.hash_ids[0], 0) + 1
    return sum(1 for e in entries if e.hash_ids and counts[e.hash_ids[0]] > 1)


# --------------------------------------------------------------------------- prompts of given token counts
def vocabulary(tokenizer=None) -> list[str]:
    """Words that are one token each after a space for `tokenizer` (all of WORDS without one)."""
    words = sorted(set(WORDS))
    if tokenizer is None:
        return words
    single = [w for w in words if len(tokenizer(" " + w, add_special_tokens=False)["input_ids"]) == 1]
    return single if len(single) >= 16 else words


def words_text(rng: random.Random, vocab: Sequence[str], n: int) -> list[str]:
    return [rng.choice(vocab) for _ in range(n)]


def block_words(seed: int, hash_id: int, block_size: int, vocab: Sequence[str]) -> list[str]:
    """The words of one hash block: a function of the seed and the hash id alone."""
    return words_text(random.Random(f"block:{seed}:{hash_id}"), vocab, block_size)


def trace_prompts(entries: Sequence[TraceEntry], *, seed: int, block_size: int,
                  vocab: Sequence[str]) -> list[str | list[dict]]:
    """The prompt text of every request: given (plain JSONL), built from its hash blocks (Mooncake: the
    k-th block's words are those of hash id `hash_ids[k]`, the last block cut to the input length), or
    unique words (seeded by the request's position)."""
    prompts, blocks = [], {}
    for k, e in enumerate(entries):
        if e.prompt is not None:
            prompts.append(e.prompt)
            continue
        words: list[str] = []
        for h in e.hash_ids:
            if len(words) >= e.input_length:
                break
            if h not in blocks:
                blocks[h] = block_words(seed, h, block_size, vocab)
            words += blocks[h][:e.input_length - len(words)]
        if len(words) < e.input_length:
            words += words_text(random.Random(f"request:{seed}:{k}"), vocab, e.input_length - len(words))
        prompts.append(" ".join(words))
    return prompts


# --------------------------------------------------------------------------- shared prefixes
def shared_prefix_requests(n_requests: int, n_prompts: int, *, prefixes: int, prefix_tokens: int, seed: int,
                           vocab: Sequence[str]) -> tuple[list[str], list[int], list[int]]:
    """(the `prefixes` system prompts of `prefix_tokens` words, each request's prefix, each request's suite
    prompt index): request k carries prefix `rng.randrange(prefixes)` and suite prompt k mod n_prompts."""
    if prefixes < 1 or prefix_tokens < 1:
        raise ConfigError(f"--prefixes and --prefix-tokens must be >= 1, got {prefixes} and {prefix_tokens}")
    texts = [" ".join(words_text(random.Random(f"prefix:{seed}:{i}"), vocab, prefix_tokens)) for i in range(prefixes)]
    rng = random.Random(f"prefix-choice:{seed}")
    return texts, [rng.randrange(prefixes) for _ in range(n_requests)], [k % n_prompts for k in range(n_requests)]


# --------------------------------------------------------------------------- conversations
@dataclass
class Conversation:
    """A recorded conversation: its user turns and the recorded assistant reply after each."""

    id: str
    users: list[str]
    replies: list[str]


@dataclass
class SessionPlan:
    """One multi-turn session: its conversation (cut to `max_turns`), when it arrives, and the think time
    before each turn after the first (`think_s[k]`: before turn k+1)."""

    conversation: Conversation
    arrival_s: float
    think_s: list[float]
    first_index: int  # the flat request index of its first turn (turn k is first_index + k)

    def to_dict(self) -> dict:
        return asdict(self)


def conversations_of(rows) -> list[Conversation]:
    """ShareGPT rows (`{"id", "conversations": [{"from": "human"|"gpt", "value"}]}`) as user/assistant
    turns: leading non-human turns dropped, the pairs taken while they alternate human -> gpt."""
    out = []
    for i, row in enumerate(rows):
        turns = [t for t in (row.get("conversations") or []) if isinstance(t, dict)]
        while turns and turns[0].get("from") != "human":
            turns = turns[1:]
        users, replies = [], []
        for a, b in zip(turns[::2], turns[1::2]):
            user, reply = str(a.get("value") or "").strip(), str(b.get("value") or "").strip()
            if a.get("from") != "human" or b.get("from") != "gpt" or not user or not reply:
                break
            users.append(user)
            replies.append(reply)
        if users:
            out.append(Conversation(str(row.get("id", i)), users, replies))
    return out


def plan_sessions(conversations: Sequence[Conversation], arrivals: Sequence[float], *, max_turns: int,
                  think_time_ms: float, seed: int, min_turns: int = 1) -> list[SessionPlan]:
    """Session k is conversation k mod len (cut to `max_turns`) arriving at `arrivals[k]`; think times
    are exponential with mean `think_time_ms` (0: the next turn goes as soon as the answer is in), seeded.
    Only conversations of at least `min_turns` user turns are replayed (`min_turns == max_turns`: every
    session sends the same number of turns, so each turn's figures come from every session)."""
    if max_turns < 1:
        raise ConfigError(f"--max-turns must be >= 1, got {max_turns}")
    if not 1 <= min_turns <= max_turns:
        raise ConfigError(f"--min-turns must be between 1 and --max-turns ({max_turns}), got {min_turns}")
    if conversations and min_turns > 1:
        conversations = [c for c in conversations if len(c.users) >= min_turns]
        if not conversations:
            raise ConfigError(f"no conversation of the suite has {min_turns} user turns (--min-turns)")
    if not (think_time_ms >= 0 and math.isfinite(think_time_ms)):
        raise ConfigError(f"--think-time-ms must be a finite number >= 0, got {think_time_ms}")
    if not conversations:
        raise ConfigError("no conversation to replay (the suite has no multi-turn conversations)")
    rng = random.Random(f"think:{seed}")
    plans, index = [], 0
    for k, t in enumerate(arrivals):
        c = conversations[k % len(conversations)]
        c = Conversation(c.id, c.users[:max_turns], c.replies[:max_turns])
        think = [rng.expovariate(1000.0 / think_time_ms) if think_time_ms > 0 else 0.0 for _ in c.users[1:]]
        plans.append(SessionPlan(c, float(t), think, index))
        index += len(c.users)
    return plans


# --------------------------------------------------------------------------- per-turn results
def _pcts(values: list[float]) -> dict:
    import numpy as np

    if not values:
        return {"p50": None, "p90": None}
    return {"p50": float(np.percentile(values, 50)), "p90": float(np.percentile(values, 90))}


def history_bucket(tokens: int) -> tuple[int, int]:
    """[lo, hi) of the power-of-two bucket a history length falls in ([0, 64) first)."""
    if tokens < 64:
        return 0, 64
    lo = 1 << (int(tokens).bit_length() - 1)
    return lo, 2 * lo


def per_turn(timings, turn_of: dict[int, int]) -> dict:
    """TTFT p50 / p90 of successful requests by turn (1-based) and by history length (the request's
    prompt tokens, power-of-two buckets): `{"by_turn": [...], "by_history": [...]}`."""
    by_turn: dict[int, list] = {}
    by_hist: dict[tuple[int, int], list] = {}
    for t in timings:
        if t.prompt_index not in turn_of or not t.token_ns:
            continue
        by_turn.setdefault(turn_of[t.prompt_index], []).append(t)
        by_hist.setdefault(history_bucket(t.prompt_tokens), []).append(t)
    turns = [{"turn": k + 1, "requests": len(ts), "ttft_ms": _pcts([t.ttft_ms for t in ts]),
              "history_tokens_p50": _pcts([t.prompt_tokens for t in ts])["p50"]} for k, ts in sorted(by_turn.items())]
    hist = [{"history_tokens": [lo, hi], "requests": len(ts), "ttft_ms": _pcts([t.ttft_ms for t in ts])}
            for (lo, hi), ts in sorted(by_hist.items())]
    return {"by_turn": turns, "by_history": hist}
