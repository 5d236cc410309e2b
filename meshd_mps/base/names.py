"""The program name rule, in one place: the manifest's ``name``, the API's paths, ``Programs``.

A name becomes a path segment (``/v1/programs/NAME``), a log field and a file name in a state
dir, so it is a short run of portable characters that cannot be read as a path: no leading dot
or dash, no ``..``.
"""

from __future__ import annotations

import re

from meshd_mps.base.errors import BadName

NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,63}")
RULE = "1-64 characters of A-Z a-z 0-9 _ . -, starting with a letter, digit or _, without '..'"


def check_name(name: object, what: str = "program name") -> str:
    """``name`` if it keeps the rule, else BadName (``what`` says where it came from)."""
    if not isinstance(name, str):
        raise BadName(f"{what}: a string expected, got {type(name).__name__}", name=repr(name))
    if not NAME.fullmatch(name) or ".." in name:
        raise BadName(f"{what} {name[:80]!r}: {RULE}", name=name[:80])
    return name
