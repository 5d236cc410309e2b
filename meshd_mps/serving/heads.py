"""What the API checks of a request's head before any route: its size as a whole (aiohttp's parser
bounds each line, not the head) and its path's segments."""

from __future__ import annotations

import urllib.parse

from aiohttp import web

from meshd_mps.serving.status import HeadRefused

#: The request head (its request line and header lines together) at most, 431 beyond: checked as
#: a whole once parsed (:func:`head_size`), and per line by the parser as it reads, so that a line
#: over it is refused before the rest arrives.  Header lines at most (400 beyond).
MAX_HEAD = 64 << 10
MAX_HEADERS = 100


def path_of(request: web.BaseRequest) -> str:
    return request.rel_url.raw_path


def check_path(request: web.BaseRequest) -> None:
    """Before the route: no '.' or '..' segment (a client or proxy may resolve it to another
    program's path: ``DELETE /v1/programs/echo/../other``), every segment UTF-8 once decoded."""
    path = path_of(request)
    for raw in path[1:].split("/"):
        try:
            seg = urllib.parse.unquote(raw, errors="strict")
        except UnicodeDecodeError as e:
            raise HeadRefused(f"path {path[:80]!r}: not UTF-8") from e
        if seg in (".", ".."):
            raise HeadRefused(f"path {path[:80]!r}: '.' and '..' segments are refused")


def head_size(request: web.BaseRequest) -> int:
    """The request head's size in bytes as parsed: the request line and every header line with
    their line ends, and the blank line (blanks around a header's value not counted)."""
    v = request.version
    size = len(request.method) + len(request.raw_path) + len(f"  HTTP/{v.major}.{v.minor}\r\n") + 2
    return size + sum(len(k) + len(val) + 4 for k, val in request.raw_headers)
