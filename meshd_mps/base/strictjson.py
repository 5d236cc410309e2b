"""JSON as meshd-mps reads it: strict, bounded in depth, never a deep recursion.

One reader for every JSON meshd-mps takes in: the API's bodies (the daemon), manifests (the CLI
and ``Manifest.parse``) and answers (the CLI).  It lives outside both the serving and the GPU
layers because both read JSON; standard library only, so that the CLI's fast start keeps it.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

#: Arrays and objects nested deeper than this are refused (the API's bodies, manifests, answers).
MAX_JSON_DEPTH = 32
#: Integers in JSON input with more digits than this are refused (u64's largest has 20).
MAX_INT_DIGITS = 64
#: Input with more commas than this outside its strings (an array of n elements, or an object of n
#: members, has n - 1) is refused before it is parsed: a body or a manifest has tens, and 30
#: million numbers in a 60 MiB body held the event loop ~12 s in the parse.
MAX_JSON_VALUES = 100_000


class JSONRefused(ValueError):
    """JSON text refused: too deep, not UTF-8, NaN, a duplicate key, ... (the message says which)."""


#: A JSON string, its escaped quotes and backslashes already removed (an unclosed one runs to the end).
_STRINGS = re.compile(r'"[^"]*"?')
_NOT_BRACKETS = re.compile(r"[^\[\]{}]+")
_PARENS = str.maketrans("[{]}", "(())")
_SURROGATE = re.compile("[\ud800-\udfff]")


def _outside_strings(text: str) -> str:
    """JSON ``text`` less its strings, in C-speed passes: escaped backslashes and quotes dropped
    first, so that no quote inside a string ends it.  What both scans before the parse read."""
    if "\\" in text:
        text = text.replace("\\\\", "").replace('\\"', "")
    return _STRINGS.sub("", text)


def _nested_over(bare: str, limit: int) -> bool:
    """``json_deeper_than`` on text already less its strings."""
    s = _NOT_BRACKETS.sub("", bare).translate(_PARENS)
    for levels in range(limit + 1):
        t = s.replace("()", "")
        if len(t) == len(s):
            return levels + max(0, s.count("(") - s.count(")")) > limit
        s = t
    return True


def json_deeper_than(text: str, limit: int) -> bool:
    """Whether JSON ``text`` nests arrays and objects more than ``limit`` deep, found without
    parsing it and without recursion, in a few passes of C-speed string operations: every string
    dropped (``_outside_strings``), then everything but brackets; what is left is brackets only.
    Each pass then removes every innermost pair ``()`` at once, one level; a balanced text of
    depth d is gone in d passes.  Brackets left unmatched (invalid JSON) count as open levels (an
    upper bound, never less than what ``json.loads`` would recurse into before finding the error)."""
    return _nested_over(_outside_strings(text), limit)


def _refuse_constant(name: str) -> Any:
    raise JSONRefused(f"{name} is not a JSON number (RFC 8259: numbers are finite)")


def _finite(text: str) -> float:
    v = float(text)
    if not math.isfinite(v):
        raise JSONRefused(f"the number {text[:40]} is out of range (a finite double expected)")
    return v


def _bounded_int(text: str) -> int:
    digits = len(text) - (text[0] == "-")
    if digits > MAX_INT_DIGITS:
        raise JSONRefused(f"an integer of {digits} digits (at most {MAX_INT_DIGITS})")
    return int(text)


def _unique(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise JSONRefused(f"the key {k[:80]!r} appears twice in one object")
        out[k] = v
    return out


def _check_strings(obj: Any) -> None:
    todo = [obj]  # at most MAX_JSON_DEPTH deep, walked without recursion all the same
    while todo:
        v = todo.pop()
        if isinstance(v, str):
            if _SURROGATE.search(v):
                raise JSONRefused("a string with a lone surrogate escape (\\ud800-\\udfff): not Unicode text")
        elif isinstance(v, dict):
            todo.extend(v)
            todo.extend(v.values())
        elif isinstance(v, list):
            todo.extend(v)


def parse_json(data: bytes | str, *, strict: bool = True, max_depth: int = MAX_JSON_DEPTH) -> Any:
    """JSON text as meshd-mps reads it; JSONRefused (a ValueError) says what is wrong.  Always:
    UTF-8 (bytes), at most ``max_depth`` levels of arrays and objects (checked before parsing).
    ``strict`` (input: bodies, manifests) also refuses NaN and Infinity, numbers out of a double's
    range, integers over ``MAX_INT_DIGITS`` digits, more than ``MAX_JSON_VALUES`` values, a key
    twice in one object and lone surrogates."""
    if isinstance(data, (bytes, bytearray, memoryview)):
        try:
            text = bytes(data).decode("utf-8")
        except UnicodeDecodeError as e:
            raise JSONRefused(f"not UTF-8 (byte {e.start}: {bytes(data)[e.start:e.start + 1]!r})") from e
    else:
        text = data
    bare = _outside_strings(text)  # once, for both scans: a 64 MiB body's PTX is one string
    if _nested_over(bare, max_depth):
        raise JSONRefused(f"nested deeper than the limit of {max_depth} levels of arrays and objects")
    if strict and bare.count(",") > MAX_JSON_VALUES:  # an array of n elements has n - 1
        raise JSONRefused(f"more than {MAX_JSON_VALUES} values in its arrays and objects")
    try:
        if not strict:
            return json.loads(text)
        obj = json.loads(text, parse_constant=_refuse_constant, parse_float=_finite, parse_int=_bounded_int,
                         object_pairs_hook=_unique)
    except RecursionError as e:  # not reached (the scan comes first): a JSON error all the same
        raise JSONRefused(f"nested deeper than the limit of {max_depth} levels of arrays and objects") from e
    except JSONRefused:
        raise
    except ValueError as e:
        raise JSONRefused(str(e)) from e
    _check_strings(obj)
    return obj
