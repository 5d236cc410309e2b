"""The daemon's JSON answers, one shape for all: ``{"ok": true, ...}``, or a refusal by its error's
type through the one table (``status.status_of``); shared by the control API, its connection
handler and the fleet's call port."""

from __future__ import annotations

import json
from typing import Any

from aiohttp import web

from meshd_mps.base.errors import MeshError
from meshd_mps.serving.status import status_of

#: On every answer of ours: which server, without aiohttp's and Python's versions.
SERVER = {"Server": "meshd-mps"}
INTERNAL = "internal error (the daemon's log has the traceback)"


def body(obj: dict[str, Any]) -> bytes:
    return (json.dumps(obj, default=str) + "\n").encode()


def answer(status: int, obj: dict[str, Any]) -> web.Response:
    return web.Response(status=status, body=body(obj), content_type="application/json", charset="utf-8",
                        headers=SERVER)


def refused(e: MeshError | None) -> tuple[int, dict[str, Any]]:
    """An error's status and answer (None: an internal error, said in generic words)."""
    if e is None:
        return 500, {"ok": False, "error": INTERNAL}
    return status_of(e), {"ok": False, **e.fields(), "error": str(e)}  # the message wins over a field
