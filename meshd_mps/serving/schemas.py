"""The control API's request bodies, each checked whole before anything is touched.

A body is read only once its route is known and its framing is fine (a Content-Length of at most
``client.MAX_BODY``, never chunked: :func:`check_framing`), within ``Deadlines.http_body``, and
parsed as strict JSON (``strictjson.parse_json``: UTF-8, at most 32 levels, no NaN, no key
twice, ...).  The schemas here check a body's own shape (fields, types, the obvious ranges);
what a value means for the GPU or the running programs (a GPU ordinal served here, a name that is
free, blocks that fit) is checked once, where that concept lives (Backend, Programs, limits), and
raised there as a typed error.  The daemon takes PTX only: it never compiles CUDA C (the CLI does,
as its user), so that no request makes it read a file (``#include``).
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import anyio
from aiohttp import web

from meshd_mps.base.deadlines import Deadlines
from meshd_mps.base.errors import BadRestartPolicy, BadRestoreMode
from meshd_mps.base.restart import Policy
from meshd_mps.base.restore import Restore
from meshd_mps.base.strictjson import parse_json
from meshd_mps.gpu.compiler import Manifest
from meshd_mps.serving.client import BINARY, MAX_BODY
from meshd_mps.serving.status import BadBody, BodyTooLarge, EncodingRefused, LengthRequired, RequestTimeout

LOAD_FIELDS = ("manifest", "ptx", "hash", "nodes", "device", "restart", "restore", "data", "lease_until")
LEASE_FIELDS = ("until", "programs")
_KEY = re.compile(r"[0-9a-f]{64}")
CALL_FIELDS = ("data", "hex", "timeout")
#: The answer to a body with CUDA C: the daemon never compiles it (an ``#include`` would read any
#: file the daemon can read, and the compile log would echo it to the client).
PTX_ONLY = ("field 'cuda': this daemon takes PTX only; it does not compile CUDA C (an #include would read files as"
            " the daemon's user). The CLI compiles CUDA C itself, as you, and sends PTX: meshd-mps load DIR (with a"
            " .cu file), or meshd-mps load --manifest FILE --cuda FILE")


def check_framing(request: web.BaseRequest, limit: int = MAX_BODY) -> None:
    """Before the route: a body the daemon can refuse by its size before reading any of it
    (``limit``: the route's; a data file's is larger, serving/data_api.py)."""
    if "Transfer-Encoding" in request.headers:
        raise LengthRequired("chunked bodies are not supported: send Content-Length")
    coding = request.headers.get("Content-Encoding", "identity")
    if coding.strip().lower() != "identity":
        raise EncodingRefused(f"Content-Encoding {coding[:40]!r} is not supported: send the body as it is",
                              encoding=coding[:40])
    n = request.content_length  # the parser took only digits
    if n is not None and n > limit:
        raise BodyTooLarge(f"body of {n} bytes is over the limit of {limit} bytes ({limit >> 20} MiB)", size=n, limit=limit)


_HEX = re.compile(r"(?:[0-9a-fA-F]{2})*")


async def json_body(request: web.BaseRequest, within: float) -> dict[str, Any]:
    """The body as a JSON object, received within ``within`` seconds (RequestTimeout otherwise)."""
    try:
        with anyio.fail_after(within):
            data = await request.read()
    except TimeoutError as e:
        raise RequestTimeout(f"body not received in {within:g}s", within=within) from e
    except web.HTTPRequestEntityTooLarge as e:  # check_framing refuses it first; aiohttp's client_max_size as well
        raise BodyTooLarge(f"body over the limit of {MAX_BODY} bytes (64 MiB)", size=MAX_BODY + 1, limit=MAX_BODY) from e
    if not data.strip():
        raise BadBody("body: a JSON object expected, got an empty body")
    try:
        obj = parse_json(data)
    except ValueError as e:
        raise BadBody(f"body: not JSON: {e}") from e
    if not isinstance(obj, dict):
        raise BadBody(f"body: a JSON object expected, got {_jtype(obj)}")
    return obj


def _jtype(v: Any) -> str:
    """A JSON value's type, in JSON's words."""
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "boolean"
    return {int: "integer", float: "number", str: "string", list: "array", dict: "object"}.get(type(v), type(v).__name__)


def _show(v: Any, n: int = 80) -> str:
    """A value as an error message quotes it: its repr, cut to ``n`` characters."""
    r = repr(v)
    return r if len(r) <= n else r[: n - 3] + "..."


def check_fields(obj: dict[str, Any], allowed: tuple[str, ...]) -> None:
    for k in obj:
        if k not in allowed:
            raise BadBody(f"unknown field {_show(k)} (expected {', '.join(allowed)})", field=k[:80])


def _int_field(obj: dict[str, Any], key: str) -> int | None:
    v = obj.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int):
        raise BadBody(f"field {key!r}: an integer expected, got {_jtype(v)}", field=key)
    return v


def _string_field(obj: dict[str, Any], key: str) -> str:
    v = obj[key]
    if not isinstance(v, str):
        raise BadBody(f"field {key!r}: a string expected, got {_jtype(v)}", field=key)
    return v


@dataclass
class LoadBody:
    """A load or upgrade request's body, checked (not an image yet: Backend prepares that from it)."""

    manifest: Manifest
    text: str  # PTX
    hash: int | None  # the image hash required (field "hash"); None: any
    nodes: int | None
    device: int | None = None
    restart: Policy | None = None  # None: the daemon's default (a load), the program's own (an upgrade)
    restore: Restore | None = None  # None: reload (a load), the program's own (an upgrade, which keeps it)
    data: str | None = None  # the SHA-256 of data the daemon holds (POST /v1/data); None: none (an upgrade: kept)
    lease_until: float | None = None  # unloaded by the daemon past this wall-clock time unless renewed (leases.py)


def load_body(obj: dict[str, Any]) -> LoadBody:
    """A load/upgrade body.  ``device`` is only an integer here: Backend says whether it is a GPU
    served here; ``nodes`` at least 1: Programs says whether it fits the GPU (409)."""
    if "cuda" in obj:
        raise BadBody(PTX_ONLY, field="cuda")
    check_fields(obj, LOAD_FIELDS)
    if "manifest" not in obj:
        raise BadBody("field 'manifest' is missing", field="manifest")
    raw = obj["manifest"]
    if isinstance(raw, str):  # a manifest's JSON text: read as strictly as the body
        try:
            raw = parse_json(raw)
        except ValueError as e:
            raise BadBody(f"field 'manifest': not JSON: {e}", field="manifest") from e
    if not isinstance(raw, dict):
        raise BadBody(f"field 'manifest': a JSON object expected, got {_jtype(raw)}", field="manifest")
    m = Manifest.parse(raw)  # ManifestError (the name rule's BadName too) names the field: 400
    if "ptx" not in obj:
        raise BadBody("field 'ptx' (the program's PTX text) is missing", field="ptx")
    text = _string_field(obj, "ptx")
    if not text.strip():
        raise BadBody("field 'ptx' is empty", field="ptx")
    required = None
    if obj.get("hash") is not None:
        h = obj["hash"]
        if not isinstance(h, str) or len(h) != 16 or any(c not in "0123456789abcdefABCDEF" for c in h):
            raise BadBody(f"field 'hash' {_show(h)}: 16 hex digits expected", field="hash")
        required = int(h, 16)
    nodes = _int_field(obj, "nodes")
    if nodes is not None and nodes < 1:
        raise BadBody(f"field 'nodes' {nodes}: at least 1", field="nodes")
    restart = None
    if obj.get("restart") is not None:
        try:
            restart = Policy.parse(obj["restart"])
        except BadRestartPolicy as e:
            raise e.prefixed("field 'restart'") from e
    restore = None
    if obj.get("restore") is not None:
        try:
            restore = Restore.parse(obj["restore"])
        except BadRestoreMode as e:
            raise e.prefixed("field 'restore'") from e
    data = None
    if obj.get("data") is not None:
        data = obj["data"]
        if not isinstance(data, str) or not _KEY.fullmatch(data):
            raise BadBody(f"field 'data' {_show(data)}: the SHA-256 (64 lowercase hex digits) that POST /v1/data answered",
                          field="data")
    return LoadBody(m, text, required, nodes, _int_field(obj, "device"), restart, restore, data,
                    _time_field(obj, "lease_until"))


def _time_field(obj: dict[str, Any], key: str) -> float | None:
    """A wall-clock time (seconds since the epoch, a finite number above 0), or None if absent."""
    v = obj.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v < 1e12:
        raise BadBody(f"field {key!r} {_show(v)}: a time in seconds since the epoch expected", field=key)
    return float(v)


def leases(obj: dict[str, Any]) -> tuple[float, list[str]]:
    """A lease renewal: ``{"until": T, "programs": [NAME, ...]}``."""
    check_fields(obj, LEASE_FIELDS)
    until = _time_field(obj, "until")
    if until is None:
        raise BadBody("field 'until' (seconds since the epoch) is missing", field="until")
    names = obj.get("programs")
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise BadBody(f"field 'programs': a list of program names expected, got {_jtype(names)}", field="programs")
    return until, names


@dataclass
class Call:
    """A call request, checked: the bytes for the ring and how long to wait for the answer."""

    payload: bytes
    timeout: float  # seconds to wait for the answer (field "timeout")


CALL_QUERY = ("timeout",)


def binary(request: web.BaseRequest) -> bool:
    """The call's body is its payload's bytes: it says ``Content-Type: application/octet-stream``
    (a body that says no type is the JSON form's, as before, though aiohttp reads it as that type)."""
    return "Content-Type" in request.headers and request.content_type == BINARY


def call_timeout(query: Mapping[str, str], deadlines: Deadlines) -> float | None:
    """A call's ``?timeout=S`` (None: not given); BadBody for any other parameter, or a value that is
    not seconds within the call's bounds."""
    for k in query:
        if k not in CALL_QUERY:
            raise BadBody(f"unknown query parameter {_show(k)} (expected {', '.join(CALL_QUERY)})", field=k[:80])
    if "timeout" not in query:
        return None
    text = query["timeout"]
    try:
        t = float(text)
    except ValueError:
        t = math.nan
    return _timeout(t if t == t else text, deadlines)  # NaN (or no number) is refused by _timeout


def _timeout(t: Any, deadlines: Deadlines) -> float:
    if isinstance(t, bool) or not isinstance(t, (int, float)) or not 0 < t <= deadlines.call_max:
        raise BadBody(f"field 'timeout' {_show(t)}: seconds, more than 0 and at most {deadlines.call_max:g}",
                      field="timeout")
    return float(t)


async def binary_body(request: web.BaseRequest, within: float) -> bytes:
    """A binary call's payload, received within ``within`` seconds (RequestTimeout otherwise)."""
    try:
        with anyio.fail_after(within):
            return await request.read()
    except TimeoutError as e:
        raise RequestTimeout(f"body not received in {within:g}s", within=within) from e
    except web.HTTPRequestEntityTooLarge as e:  # check_framing refuses it first; aiohttp's client_max_size as well
        raise BodyTooLarge(f"body over the limit of {MAX_BODY} bytes (64 MiB)", size=MAX_BODY + 1, limit=MAX_BODY) from e


def call(obj: dict[str, Any], deadlines: Deadlines, query: Mapping[str, str] | None = None) -> Call:
    """A call body (the JSON form).  The payload's size is the program's to check (its manifest's
    max_request, PayloadTooLarge).  ``query``: the request's (``?timeout=S``, said once: here or in
    the body)."""
    check_fields(obj, CALL_FIELDS)
    if ("data" in obj) == ("hex" in obj):
        raise BadBody("one of the fields 'data' (text) or 'hex' (bytes in hex) is needed")
    if "data" in obj:
        payload = _string_field(obj, "data").encode()
    else:
        text = _string_field(obj, "hex")
        if not _HEX.fullmatch(text):  # bytes.fromhex also takes blanks, and says its faults in its own words
            raise BadBody(f"field 'hex' {_show(text)}: pairs of hex digits (0-9, a-f) expected, no blanks",
                          field="hex")
        payload = bytes.fromhex(text)
    timeout = call_timeout(query or {}, deadlines)
    if obj.get("timeout") is not None:
        if timeout is not None:
            raise BadBody("field 'timeout' and the query's timeout: say it once", field="timeout")
        timeout = _timeout(obj["timeout"], deadlines)
    return Call(payload, deadlines.call if timeout is None else timeout)


NATIVE_FIELDS = ("pid",)


#: Linux numbers processes 1 .. PID_MAX_LIMIT (4194304 on 64-bit).
MAX_PID = 1 << 22


def native(obj: dict[str, Any]) -> int:
    """A native client's registration: ``{"pid": N}``."""
    check_fields(obj, NATIVE_FIELDS)
    pid = _int_field(obj, "pid")
    if pid is None:
        raise BadBody("field 'pid' (the native client's process id) is missing", field="pid")
    if not 1 <= pid <= MAX_PID:
        raise BadBody(f"field 'pid' {pid}: a process id is 1 to {MAX_PID}", field="pid")
    return pid


def pid_segment(text: str) -> int:
    """A pid in a path (``/v1/native/PID``)."""
    if not (text.isascii() and text.isdigit()) or len(text) > 10 or not 1 <= int(text) <= MAX_PID:
        raise BadBody(f"path segment {text[:40]!r}: a process id (1 to {MAX_PID}) expected")
    return int(text)
