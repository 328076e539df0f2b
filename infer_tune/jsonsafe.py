"""JSON from outside (a server's events, result files, load and plan files, manifests) read with its nesting
bounded: `loads` parses like `json.loads` and raises `json.JSONDecodeError` (so every reader's existing
handler gives its one-line error) for text nested deeper than MAX_DEPTH levels, including text so deep that
the parser itself runs out of stack (200,000 `[`: a RecursionError, exit 3 before), and for an integer
beyond what a float holds (`10**400`: every reader that compares or averages it raised OverflowError, exit 3
before). docs/hardening.md."""

from __future__ import annotations

import json
from typing import Any

MAX_DEPTH = 64  # no document infer-tune reads nests deeper than about 8 levels
MAX_INT_DIGITS = 308  # a float holds up to about 1.8e308: a longer integer overflows wherever it is used as one


class TooDeep(json.JSONDecodeError):
    """JSON nested deeper than the bound (a JSONDecodeError, so readers' handlers apply), said in one phrase."""

    def __str__(self) -> str:
        return self.msg


class TooLarge(TooDeep):
    """An integer too large for a float (a JSONDecodeError), said in one phrase."""


def _bounded_int(text: str) -> int:
    digits = text.lstrip("-")
    if len(digits) > MAX_INT_DIGITS:
        raise TooLarge(f"holds an integer of {len(digits)} digits, beyond any measurement", text[:40], 0)
    return int(text)


def depth(value: Any) -> int:
    """The nesting depth of a parsed value (a scalar is 0), counted without recursion."""
    deepest = 0
    stack = [(value, 1)]
    while stack:
        item, level = stack.pop()
        if isinstance(item, dict):
            children = item.values()
        elif isinstance(item, list):
            children = item
        else:
            continue
        deepest = max(deepest, level)
        if deepest > MAX_DEPTH:
            return deepest
        stack.extend((child, level + 1) for child in children if isinstance(child, (dict, list)))
    return deepest


def loads(text: str | bytes, max_depth: int = MAX_DEPTH) -> Any:
    """`json.loads(text)`, refused (json.JSONDecodeError) beyond `max_depth` levels of nesting."""
    source = text.decode("utf-8") if isinstance(text, (bytes, bytearray)) else text
    try:
        value = json.loads(source, parse_int=_bounded_int)
    except RecursionError:
        raise TooDeep(f"nested deeper than {max_depth} levels", source[:80], 0) from None
    if isinstance(value, (dict, list)) and depth(value) > max_depth:
        raise TooDeep(f"nested deeper than {max_depth} levels", source[:80], 0)
    return value
