"""The control API: an aiohttp ``web.Application`` over one daemon's Backend and Programs.

Routes: GET /v1/status, GET/POST /v1/programs, GET/PUT/DELETE /v1/programs/{name},
POST /v1/programs/{name}/call, GET /metrics (docs/operations.md, "The control API").  Every answer
but the metrics is JSON: ``{"ok": true, ...}``, or ``{"ok": false, "error": "...", **fields}`` for a refusal,
answered by its type through the one table (``status.status_of``) in one middleware
(:meth:`Api.checked`); anything else is a 500 whose traceback goes to the log only.  A bad
request changes nothing: its body is checked whole (``schemas``) and Programs and Backend make
their own typed checks before they change anything.

Its connections are served by ``serving/connection.py``'s handler (a refused head answered as every
refusal is, a deadline for the first head).  aiohttp's parser bounds each line of a head, not the
head: a head over ``MAX_HEAD`` as a whole is refused (431) by the middleware, before anything else
is looked at.
"""

from __future__ import annotations

import asyncio
import os
import time
import traceback
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from typing import Any

import anyio
import structlog
from aiohttp import web
from aiohttp.http import HttpVersion11

from meshd_mps.backend import Backend
from meshd_mps.base.deadlines import Deadlines
from meshd_mps.base.errors import MeshError, NotNative, NotServedHere, Unavailable, UpgradeMismatch
from meshd_mps.base.names import check_name
from meshd_mps.base.restore import Restore
from meshd_mps.programs import Program, Programs
from meshd_mps.programs.data import DataRef
from meshd_mps.serving import schemas
from meshd_mps.serving.answers import SERVER, answer, refused
from meshd_mps.serving.client import MAX_BODY
from meshd_mps.serving.connection import Protocol
from meshd_mps.serving.data_api import MAX_DATA, DataRoutes
from meshd_mps.serving.heads import MAX_HEAD, MAX_HEADERS, check_path, head_size, path_of
from meshd_mps.serving.leases import Leases
from meshd_mps.serving.metrics import CONTENT_TYPE as METRICS_TYPE, Metrics
from meshd_mps.serving.status import (
    ExpectRefused,
    HeadTooLarge,
    MethodNotAllowed,
    NoRoute,
    VersionNotSupported,
    log_level,
)
from meshd_mps.supervision import cpus

log = structlog.get_logger("meshd_mps")

#: One trailing slash names the same route.
SLASH = "{slash:/?}"
#: The request's key for the program a load names (its manifest's), once its body was read.
PROGRAM = web.RequestKey("program", str)
#: The request's key for its verb where it is a load or an upgrade ("load", "upgrade"; None otherwise).
LOADING = web.RequestKey("loading", str)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _name(request: web.Request) -> str:
    return check_name(request.match_info["name"])


def _fault(f: Any) -> dict[str, Any]:
    """A FaultReport as JSON (its fields, the time in ISO 8601)."""
    d = dict(getattr(f, "__dict__", {}))
    if isinstance(d.get("at"), (int, float)):
        d["at"] = datetime.fromtimestamp(d["at"], UTC).isoformat()
    return d


class Api:
    """The routes over one daemon's live objects, and the requests in flight (for the drain)."""

    def __init__(self, backend: Backend, programs: Programs, metrics: Metrics, *, socket_path: str,
                 versions: dict[str, str], started: datetime, t0: float, deadlines: Deadlines,
                 leases: Leases | None = None):
        self.b, self.ps, self.metrics = backend, programs, metrics
        self.leases = leases or Leases(None, deadlines, live=False)
        self.socket_path, self.versions, self.started, self.t0 = socket_path, versions, started, t0
        self.deadlines = deadlines
        self.stopping = False
        #: The desired state's dir and what the start restored from it (serving/server.py).
        self.state: dict[str, Any] | None = None
        #: Where serve --metrics-address serves /metrics over TCP (None: off).
        self.metrics_address: str | None = None
        self.busy: set[asyncio.Task[Any]] = set()
        self.data = DataRoutes(programs, deadlines, answer)  # POST /v1/data, .../write (data_api.py)
        self._idle = asyncio.Event()
        self._idle.set()

    def app(self) -> web.Application:
        app = web.Application(client_max_size=MAX_BODY, middlewares=[self.checked])
        routes: list[tuple[str, dict[str, Handler]]] = [
            ("/v1/status", {"GET": self.get_status}),
            ("/v1/programs", {"GET": self.get_programs, "POST": self.post_program}),
            ("/v1/programs/{name}", {"GET": self.get_program, "PUT": self.put_program, "DELETE": self.delete_program}),
            ("/v1/programs/{name}/call", {"POST": self.post_call}),
            ("/v1/leases", {"POST": self.post_leases}),
            ("/v1/programs/{name}/write", {"POST": self.data.post_write}),
            ("/v1/data", {"POST": self.data.post_data}),
            ("/v1/native", {"GET": self.get_native, "POST": self.post_native}),
            ("/v1/native/{pid}", {"DELETE": self.delete_native}),
            ("/metrics", {"GET": self.get_metrics}),
        ]
        for path, methods in routes:
            for method, handler in methods.items():
                app.router.add_route(method, path + SLASH, handler, expect_handler=self.expect)
        return app

    async def expect(self, request: web.Request) -> web.StreamResponse | None:
        """``Expect: 100-continue`` answered as aiohttp answers it; another expectation refused
        (417) through the one table, as JSON (aiohttp's own refusal was text/plain)."""
        expect = request.headers.get("Expect", "")
        if request.version != HttpVersion11:
            return None
        if expect.lower() != "100-continue":
            return answer(*refused(ExpectRefused(f"Expect {expect[:40]!r}: only 100-continue is understood",
                                                  expect=expect[:40])))
        await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        request.writer.output_size = 0  # the interim answer is no part of the response's size
        return None

    def protocols(self, server: web.Server) -> Callable[[], Protocol]:
        """The factory of connection handlers for ``loop.create_server`` (``server``: the runner's)."""
        loop = asyncio.get_running_loop()
        head = self.deadlines.http_head
        # keepalive_timeout: after an answer, the next request's head has as long.  auto_decompress
        # off: a Content-Encoding is refused (415, schemas.check_framing), not decoded by the parser
        # as the body arrives (a body that was not what it said was an unhandled error there).
        return lambda: Protocol(server, self, loop=loop, keepalive_timeout=head, tcp_keepalive=False, access_log=None,
                                max_line_size=MAX_HEAD, max_field_size=MAX_HEAD, max_headers=MAX_HEADERS,
                                lingering_time=self.deadlines.http_linger, auto_decompress=False)

    # ---- every request ----------------------------------------------------------------------
    @web.middleware
    async def checked(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        """Every refusal answered by its type; in-flight requests counted for the drain."""
        if isinstance(request.protocol, Protocol):
            request.protocol.heard = True
        if (verb := self._loading(request)) is not None:  # for the log of a refusal
            request[LOADING] = verb
            if "name" in request.match_info:  # an upgrade's; a load's once its body is read
                request[PROGRAM] = request.match_info["name"]
        task = asyncio.current_task()
        assert task is not None
        self.busy.add(task)
        self._idle.clear()
        t0 = time.perf_counter()
        try:
            resp = await self._checked(request, handler)
        except ConnectionError:
            raise  # the client is gone: nobody to answer
        except MeshError as e:
            resp = self.refusal(request, e)
        except Exception:
            log.error(f"{request.method} {path_of(request)}: internal error", traceback=traceback.format_exc())
            resp = self.refusal(request, None)
        finally:
            self.busy.discard(task)
            if not self.busy:
                self._idle.set()
        log.debug(f"http {request.method} {path_of(request)} {resp.status}", ms=round((time.perf_counter() - t0) * 1e3, 2))
        return resp

    async def _checked(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        size = head_size(request)
        if size > MAX_HEAD:  # logged by refusal (status.log_level)
            raise HeadTooLarge(f"request head of {size} bytes: over the limit of {MAX_HEAD} bytes (64 KiB) for the"
                               " request line and the headers together")
        if request.version.major != 1:
            v = request.version
            raise VersionNotSupported(f"HTTP/{v.major}.{v.minor}: only HTTP/1.x is served")
        check_path(request)
        schemas.check_framing(request, MAX_DATA if request.match_info.handler == self.data.post_data else MAX_BODY)
        if self.stopping:
            raise Unavailable("meshd-mps is shutting down")
        try:
            return await handler(request)
        except web.HTTPNotFound as e:
            raise NoRoute(f"no route {request.method} {path_of(request)[:200]}") from e
        except web.HTTPMethodNotAllowed as e:
            allowed = tuple(sorted(e.allowed_methods))
            raise MethodNotAllowed(f"{request.method} {path_of(request)}: method not allowed (allowed: {', '.join(allowed)})",
                                   allowed=allowed) from e

    def _loading(self, request: web.Request) -> str | None:
        """"load" or "upgrade" where the request is one (by its route's handler), else None."""
        loads: dict[Any, str] = {self.post_program: "load", self.put_program: "upgrade"}
        return loads.get(request.match_info.handler)

    def _log_refusal(self, request: web.BaseRequest, e: MeshError, status: int) -> None:
        """Every refusal logged once, here, at its level (``status.log_level``): a refused load or
        upgrade names its program (the manifest's, once the body was read; the path's for an
        upgrade) and says why."""
        verb = request.get(LOADING)
        level = log_level(e, verb is not None)
        if level is None:
            return
        if verb is not None:
            name = request.get(PROGRAM)
            getattr(log, level)(f"{verb} {name or '(no program name: the body was refused)'} refused ({status}): {e}",
                                program=name, code=status, type=type(e).__name__)
        else:
            getattr(log, level)(f"{request.method} {path_of(request)[:200]}: {e}", code=status, type=type(e).__name__)

    def refusal(self, request: web.BaseRequest, e: MeshError | None) -> web.Response:
        status, obj = refused(e)
        if e is not None:
            self._log_refusal(request, e, status)
        resp = answer(status, obj)
        if isinstance(e, MethodNotAllowed):
            resp.headers["Allow"] = ", ".join(e.allowed)
        if not request.content.is_eof():
            resp.force_close()  # a body refused unread (413, 411, 408) is not read after the answer either
        return resp

    async def drain(self) -> None:
        """At shutdown: new requests get 503; those in flight get ``Deadlines.http_grace`` to
        finish, then are cancelled."""
        self.stopping = True
        if not self.busy:
            return
        grace = self.deadlines.http_grace
        log.info(f"shutdown: waiting up to {grace:g}s for {len(self.busy)} requests")
        with anyio.move_on_after(grace):
            await self._idle.wait()
            return
        for t in list(self.busy):
            t.cancel()

    # ---- routes -----------------------------------------------------------------------------
    async def _json(self, request: web.Request) -> dict[str, Any]:
        return await schemas.json_body(request, self.deadlines.http_body)

    def _describe(self, p: Program) -> dict[str, Any]:
        d = self.ps.describe(p)
        d["started"] = datetime.fromtimestamp(p.started_wall, UTC).isoformat()
        d["compile_ms"] = round(p.compile_ms, 3)
        d["cached"] = p.cached
        d["lease_until"] = self.leases.until.get(p.name)
        return d

    def _device(self, d: dict[str, Any]) -> dict[str, Any]:
        """A GPU as status shows it: the backend's view, its programs, the part of its resident
        blocks they hold, and its memory as NVML last saw it (None before its first look)."""
        n = self.metrics.watch.latest.get(d["device"]) if self.metrics.watch is not None else None
        used, total = n.memory if n is not None and n.memory is not None else (None, None)
        return {**d, "programs": len(self.ps.on_device(d["device"])), "sm_share": round(self.ps.sm_share(d["device"]), 4),
                "memory_used": used, "memory_total": total}

    async def get_status(self, request: web.Request) -> web.Response:
        b, ps = self.b, self.ps
        s = b.status()
        out: dict[str, Any] = {
            "ok": True,
            "pid": os.getpid(),
            "socket": self.socket_path,
            "isolation": b.isolation,
            "gpu": b.gpu,
            "device": b.caps.name if b.caps else None,
            "sms": b.sms,
            "caps": s["caps"],
            "pool": {"idle": s.get("pool", []), "capacity": s.get("pool_cap", 0), "reserve": s.get("pool_reserve", 0),
                     "reserve_capacity": s.get("pool_reserve_cap", 0)},
            "workers": s["workers"],
            "retired": s["retired"],
            "server_pid": None,
            "clients": None,
            "daemon_pid": s.get("daemon_pid"),
            "daemon_died": s.get("daemon_died"),
            "mps_dir": s.get("mps_dir"),
            "cpus": cpus.status(),  # serve --daemon-cpus: the daemon's CPUs and its children's
            "programs": len(ps.by_name),
            "leases": {"count": len(self.leases.until), "stop_within": self.leases.stop_within},
            "data_bytes": sum(p.data_bytes for p in ps.by_name.values()),  # the programs' data, together
            "stalled": sum(1 for p in ps.by_name.values() if ps.describe(p)["state"] == "stalled"),
            "devices": [self._device(d) for d in s["devices"]],
            "loads": ps.loads,
            "requests_in_flight": len(self.busy),  # this one included
            "metrics_address": self.metrics_address,
            "faults": [_fault(f) for f in getattr(ps, "faults", [])[-10:]],
            "state": self.state,
            "uptime_s": round(time.monotonic() - self.t0, 3),
            "started": self.started.isoformat(),
            "versions": self.versions,
            # NVML's view of each GPU: the compute mode, and every process outside our server.
            "neighbours": ([n.as_dict() for _, n in sorted(self.metrics.watch.latest.items())]
                           if self.metrics.watch is not None else None),
        }
        if b.mps is not None:
            try:
                server = await b.mps.server_pid()
                out["server_pid"] = int(server) if server and server.isdigit() else server
                out["clients"] = await b.mps.clients(server) if server else []
            except MeshError as e:
                out["clients_error"] = str(e)
        else:
            out.update(blinks=s.get("blinks", 0), last_blink_ms=s.get("last_blink_ms"), context_pid=s.get("context_pid"),
                       standby_pid=s.get("standby_pid"))
        return answer(200, out)

    async def get_programs(self, request: web.Request) -> web.Response:
        programs = sorted(self.ps.by_name.values(), key=lambda p: p.slot)
        return answer(200, {"ok": True, "programs": [self._describe(p) for p in programs]})

    async def get_program(self, request: web.Request) -> web.Response:
        return answer(200, {"ok": True, "program": self._describe(self.ps.get(_name(request)))})

    def _loaded(self, p: Program, status: int) -> web.Response:
        self.metrics.loaded()
        out = {"ok": True, "program": self._describe(p)}  # the program's row, as in every verb's answer
        made = p.kernel.module.new_client
        if made is not None:  # an MPS client made for it now (the pool was down to its reserve): said, with its cost
            out["new_client"] = made.as_dict()
        return answer(status, out)

    async def post_program(self, request: web.Request) -> web.Response:
        body = schemas.load_body(await self._json(request))
        name = request[PROGRAM] = body.manifest.name  # for the log of a refusal
        # Kept before the load: never a program without its lease (a name loaded already: the load's AlreadyLoaded).
        until = body.lease_until if name not in self.ps.by_name else None
        if until is not None:
            self.leases.take(name, until)
        try:
            p = await self.ps.load(body.manifest, body.text.encode(), body.hash, body.nodes or 1, body.device, body.restart,
                                   restore=body.restore or Restore.RELOAD, data=body.data and DataRef(body.data))
        except BaseException as e:
            if until is not None:
                self.leases.drop(name)
            if isinstance(e, NotServedHere):  # Backend's check, said in the body's terms
                raise NotServedHere(f"field 'device' {e.device}: this daemon serves GPU {', '.join(map(str, e.devices))}"
                                    " (--devices)", device=e.device, devices=e.devices) from e
            raise
        return self._loaded(p, 201)

    async def put_program(self, request: web.Request) -> web.Response:
        name = _name(request)
        body = schemas.load_body(await self._json(request))
        if body.lease_until is not None:
            raise UpgradeMismatch("field 'lease_until': an upgrade keeps the program's lease (renew it: POST /v1/leases)",
                                  program=name, field="lease_until")
        if body.nodes is not None or body.device is not None or body.restore is not None:
            # What an upgrade keeps; Programs.upgrade takes neither (the manifest's name it checks itself).
            old = self.ps.get(name)
            if body.nodes is not None and body.nodes != old.nodes:
                raise UpgradeMismatch(f"field 'nodes' {body.nodes}: an upgrade keeps the program's {old.nodes} (unload"
                                      " and load to change it)", program=name, field="nodes")
            if body.device is not None and body.device != old.device:
                raise UpgradeMismatch(f"field 'device' {body.device}: an upgrade keeps the program on its GPU"
                                      f" {old.device} (unload and load to move it)", program=name, field="device")
            if body.restore is not None and body.restore is not old.restore:
                raise UpgradeMismatch(f"field 'restore' {body.restore.value!r}: an upgrade keeps the program's"
                                      f" {old.restore.value!r} (unload and load to change it)", program=name, field="restore")
        p = await self.ps.upgrade(name, body.manifest, body.text.encode(), body.hash, body.restart,
                                  data=body.data and DataRef(body.data))
        return self._loaded(p, 200)

    async def delete_program(self, request: web.Request) -> web.Response:
        name = _name(request)
        row = self._describe(self.ps.get(name))  # as it was before it was unloaded
        await self.ps.unload(name)
        self.leases.drop(name)
        out = {"ok": True, "program": row}
        if warning := self._declared(name):
            log.warning(f"unload: {warning}", program=name)
            out["warning"] = warning
        return answer(200, out)

    def _declared(self, name: str) -> str:
        """Why an unload does not last ("": it does): the config file declares the program, and
        every start loads what it declares."""
        st = self.state or {}
        if name not in st.get("declared", ()):
            return ""
        return (f"{name} is declared in {st.get('config_file')} ([program.{name}]): it is loaded again at the next"
                " start unless removed from there")

    async def post_leases(self, request: web.Request) -> web.Response:
        until, names = schemas.leases(await self._json(request))
        renewed, missing = self.leases.renew(names, until, self.ps.by_name)
        return answer(200, {"ok": True, "until": until, "renewed": renewed, "missing": missing})

    async def post_call(self, request: web.Request) -> web.Response:
        """A call: the JSON form (``data`` or ``hex``, answered in JSON), or the binary one (the body
        is the payload, ``Content-Type: application/octet-stream``, ``?timeout=S``; answered with the
        response's bytes, the call's time in ``Server-Timing``).  A payload over its program's most is
        refused (413) before its body is read."""
        name = _name(request)
        if not schemas.binary(request):
            c = schemas.call(await self._json(request), self.deadlines, request.query)
            t0 = time.perf_counter()
            got = await self.ps.call(name, c.payload, c.timeout)
            return answer(200, {"ok": True, "program": name, "data": got.decode("utf-8", "replace"), "hex": got.hex(),
                                "bytes": len(got), "ms": round((time.perf_counter() - t0) * 1e3, 3)})
        timeout = schemas.call_timeout(request.query, self.deadlines)
        self.ps.check_request(name, request.content_length or 0)
        payload = await schemas.binary_body(request, self.deadlines.http_body)
        t0 = time.perf_counter()
        got = await self.ps.call(name, payload, timeout)
        return web.Response(body=got, content_type=schemas.BINARY,
                            headers={**SERVER, "Server-Timing": f"call;dur={(time.perf_counter() - t0) * 1e3:.3f}"})

    async def get_native(self, request: web.Request) -> web.Response:
        """What a CUDA process needs to join our MPS server, and the native clients registered."""
        return answer(200, {"ok": True, "env": self.b.native_env(), "clients": self.b.natives()})

    async def post_native(self, request: web.Request) -> web.Response:
        pid = schemas.native(await self._json(request))
        await self.b.add_native(pid)
        return answer(201, {"ok": True, "native": pid, "clients": self.b.natives()})

    async def delete_native(self, request: web.Request) -> web.Response:
        pid = schemas.pid_segment(request.match_info["pid"])
        if not self.b.drop_native(pid):
            raise NotNative(pid)
        return answer(200, {"ok": True, "dropped": pid, "clients": self.b.natives()})

    async def get_metrics(self, request: web.Request) -> web.Response:
        return web.Response(body=self.metrics.exposition(), headers={**SERVER, "Content-Type": METRICS_TYPE})
