"""One connection of the control API: aiohttp's connection handler with what aiohttp has no hook for
(aio-libs/aiohttp#3287): a head its parser refuses is answered like every other refusal (JSON, by
type, counted, no traceback in the log), and a connection's first head that does not come in
``Deadlines.http_head`` gets a 408 (aiohttp's keep-alive timer would only close the connection).
A client that hangs up before its answer is counted as ``CLIENT_GONE`` (499), not as an internal
error."""

from __future__ import annotations

import asyncio
import traceback
from http import HTTPStatus
from typing import Any, Protocol as Typed

import structlog
from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError, LineTooLong

from meshd_mps.base.deadlines import Deadlines
from meshd_mps.base.errors import MeshError
from meshd_mps.serving.answers import SERVER, body, refused
from meshd_mps.serving.heads import path_of
from meshd_mps.serving.metrics import Metrics
from meshd_mps.serving.status import HeadRefused, HeadTooLarge, RequestTimeout

log = structlog.get_logger("meshd_mps")

#: The status counted (meshd_mps_http_requests_total{code="499"}) for a client that hung up before
#: its answer (in the middle of its body, say): nginx's "client closed request", as aiohttp's
#: access log writes it too.  Never sent: there is nobody to send it to.
CLIENT_GONE = 499


class Answers(Typed):
    """What a connection needs of the API it serves."""

    deadlines: Deadlines
    metrics: Metrics

    def refusal(self, request: web.BaseRequest, e: MeshError | None) -> web.Response: ...


class Protocol(web.RequestHandler):
    """One connection: aiohttp's handler, with a refused head answered like every other refusal
    and a deadline for the first head (see the module's docstring)."""

    def __init__(self, manager: web.Server, api: Answers, **kw: Any):
        super().__init__(manager, **kw)
        self.api = api
        self.heard = False  # a request's head arrived (set by Api.checked)
        self._head_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # Armed before aiohttp's own keep-alive timer, which it arms here as long: this one answers
        # 408 where that one would only close.
        self._head_timer = asyncio.get_running_loop().call_later(self.api.deadlines.http_head, self._head_late)
        super().connection_made(transport)

    def connection_lost(self, exc: BaseException | None) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
        super().connection_lost(exc)

    def _head_late(self) -> None:
        """No request in time: a 408, unasked for (RFC 9110 allows it), and the connection closed.
        Written to the transport as it is, since there is no request to answer through aiohttp."""
        if self.heard or self.transport is None:
            return
        within = self.api.deadlines.http_head
        status, obj = refused(RequestTimeout(f"no request in {within:g}s", within=within))
        payload = body(obj)
        head = (f"HTTP/1.1 {status} {HTTPStatus(status).phrase}\r\nContent-Type: application/json; charset=utf-8\r\n"
                f"Content-Length: {len(payload)}\r\nConnection: close\r\nServer: {SERVER['Server']}\r\n\r\n")
        self.transport.write(head.encode("latin-1") + payload)
        self.api.metrics.answered(status)
        log.debug(f"http - {status}")
        self.force_close()

    def handle_error(self, request: web.BaseRequest, status: int = 500, exc: BaseException | None = None,
                     message: str | None = None) -> web.StreamResponse:
        """aiohttp's answer to a head its parser refused (and to an error a handler let escape)."""
        if request.writer.output_size > 0:
            raise ConnectionError("the answer was begun; no other can be sent")
        e: MeshError | None = None
        if isinstance(exc, HttpProcessingError):
            words = " ".join((exc.message or str(exc)).split())[:300]
            e = HeadTooLarge(f"request head: {words}") if isinstance(exc, LineTooLong) else HeadRefused(f"request head: {words}")
        elif isinstance(exc, ConnectionError) and (self.transport is None or self.transport.is_closing()):
            # The client hung up (in the middle of its body, say): nobody to answer, and no fault of
            # ours.  Said once, and counted as such (log_access), never as a 500.
            log.info(f"{request.method} {path_of(request)[:200]}: the client went away before its answer",
                     code=CLIENT_GONE, error=f"{type(exc).__name__}: {exc}")
            resp = web.Response(status=CLIENT_GONE, reason="Client Closed Request", headers=SERVER)
            resp.force_close()
            return resp
        else:
            tb = "".join(traceback.format_exception(exc)) if exc is not None else f"status {status}: {message}"
            log.error(f"{request.method} {path_of(request)}: internal error", traceback=tb)
        resp = self.api.refusal(request, e)
        resp.force_close()
        log.debug(f"http - {resp.status}")
        return resp

    def log_access(self, request: web.BaseRequest, response: web.StreamResponse, started: float | None) -> None:
        """Every answer sent, counted (meshd_mps_http_requests_total); aiohttp's access log is off."""
        self.api.metrics.answered(response.status)
