"""``meshd-mps serve``: the daemon, its control API on a Unix socket, its metrics.

The control API is HTTP/1.1 + JSON, served by this module on
``asyncio.start_unix_server`` (standard library only): one request per
connection (``Connection: close``), ``Content-Length`` bodies up to 64 MiB.
Every answer is ``{"ok": true, ...}`` or ``{"ok": false, "error": "..."}``
with its status: 400 a bad request, 404 an unknown program or route, 405,
409 a conflict (already loaded, not running, the GPU full, ...), 413, 500,
503 while the daemon shuts down, 504 a call that got no response in time.  A
bad request changes nothing: the body is checked whole before any program is
touched.  Bodies are strict JSON (``client.parse_json``: UTF-8, at most
``client.MAX_JSON_DEPTH`` (32) levels, no NaN, no key twice, ...), and the daemon takes
PTX only: it never compiles CUDA C (the client does, as its user), so that no
request makes it read a file (``#include``).

The socket lives in a directory only the daemon's user can write (checked at
start: ``_check_socket_dir``), and is created 0600.

Signals: SIGTERM or SIGINT shuts down cleanly (stop accepting, the in-flight
requests finish, every program halted and unloaded, the backend closed, the
socket removed; exit status 0).  A second signal during that forces the exit:
every descendant process is killed and reaped, the socket and a temporary MPS
directory removed, and the process exits with 128 + the signal's number.
The signal handlers only record the signal; a task of the loop acts on it.
"""

from __future__ import annotations

import asyncio
import errno
import http
import importlib.metadata
import json
import os
import platform
import shutil
import signal
import socket
import stat
import sys
import time
import traceback
import urllib.parse
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import anyio.to_thread
import structlog

from meshd_mps.protocol import abi
from meshd_mps import eventloop
from meshd_mps.backend import Backend
from meshd_mps.serving.client import MAX_BODY, default_socket, parse_json, private_dirs
from meshd_mps.gpu.compiler import Manifest, nvjitlink_version
from meshd_mps.mps.control import become_subreaper
from meshd_mps.errors import MeshError, NoDriver, WorkerError
from meshd_mps.deadlines import DEFAULT
from meshd_mps.log import setup_logging
from meshd_mps.serving.metrics import CONTENT_TYPE as METRICS_TYPE, Histogram, Registry
from meshd_mps.names import RULE, NAME
from meshd_mps.programs import Program, Programs
from meshd_mps.serving.status import status_of
from meshd_mps.supervision.procfs import processes

log = structlog.get_logger("meshd_mps")

NO_DRIVER_HINT = "no NVIDIA driver on this machine; to try meshd-mps without a GPU: meshd-mps serve --gpu sim"

HEAD_S = 30.0  # to send the request line and headers
BODY_S = 120.0  # to send the body
GRACE_S = 10.0  # in-flight requests at shutdown
MONITOR_S = 1.0  # program states are checked this often (faults, deaths)
MAX_HEAD = 64 << 10
MAX_HEADERS = 100
MAX_CALL_S = 300.0
SUN_PATH_MAX = 107  # AF_UNIX: 108 bytes with the NUL
#: The socket's listen backlog: connections the kernel queues while the loop is busy (a burst of
#: clients).  The kernel caps it at net.core.somaxconn (4096 on Linux 5.4+).  Passed to
#: ``start_unix_server`` too, which listens again with its own default (100) otherwise.
BACKLOG = 1024

LOAD_FIELDS = ("manifest", "ptx", "hash", "nodes", "device")
#: The answer to a body with CUDA C: the daemon never compiles it (an ``#include`` would read any
#: file the daemon can read, and the compile log would echo it to the client).
PTX_ONLY = ("field 'cuda': this daemon takes PTX only; it does not compile CUDA C (an #include would read files as"
            " the daemon's user). The CLI compiles CUDA C itself, as you, and sends PTX: meshd-mps load DIR (with a"
            " .cu file), or meshd-mps load --manifest FILE --cuda FILE")
CALL_FIELDS = ("data", "hex", "timeout")
#: Program states the metrics always list (each 0 when no program is in it).
STATES = ("running", "stalled", "exited", "failed", "faulted")
FAILED = ("failed", "faulted")


# ---- configuration and start-up errors ----------------------------------------------------


@dataclass
class Config:
    isolation: str = "blink"
    sms: int = 0
    mps_dir: str | None = None
    pool: int | None = None  # None: 2 in MPS mode, 0 in blink mode
    gpu: str = "cuda"
    socket: str | None = None
    cache_dir: str | None = None
    log_level: str | None = None
    log_format: str | None = None  # json | console | None (JSON unless stderr is a TTY)
    loop: str = "auto"  # auto (uvloop if installed) | uvloop | asyncio
    devices: tuple[int, ...] | None = None  # the GPUs to drive (None: every visible one)
    stall_after: float | None = None  # seconds without a heartbeat before "stalled" (None: Programs' default)


class StartError(MeshError):
    """The daemon cannot start (the socket is taken, ...)."""


def main(cfg: Config) -> int:
    """Run the daemon until a signal stops it; the exit status."""
    setup_logging("meshd", cfg.log_level, json=None if cfg.log_format is None else cfg.log_format == "json")
    try:
        return eventloop.run(Daemon(cfg).run, cfg.loop)
    except NoDriver as e:
        print(f"meshd-mps: {e}", file=sys.stderr)
        print(f"meshd-mps: {NO_DRIVER_HINT}", file=sys.stderr)
        return 1
    except (MeshError, OSError) as e:
        msg = str(e) if isinstance(e, MeshError) else f"{type(e).__name__}: {e}"
        print(f"meshd-mps: {msg}", file=sys.stderr)
        return 1


# ---- versions -----------------------------------------------------------------------------


def own_version() -> str:
    try:
        return importlib.metadata.version("meshd-mps")
    except importlib.metadata.PackageNotFoundError:
        pass
    try:
        import tomllib

        with open(Path(__file__).resolve().parents[2] / "pyproject.toml", "rb") as f:
            return str(tomllib.load(f)["project"]["version"]) + "+source"
    except (OSError, KeyError, ValueError):
        return "unknown"


def versions() -> dict[str, str]:
    out = {"meshd-mps": own_version(), "python": platform.python_version()}
    try:
        out["cuda-bindings"] = importlib.metadata.version("cuda-bindings")
    except importlib.metadata.PackageNotFoundError:
        try:
            from cuda import bindings

            out["cuda-bindings"] = str(getattr(bindings, "__version__", "unknown"))
        except ImportError:
            out["cuda-bindings"] = "not installed"
    try:
        major, minor = nvjitlink_version()
        out["nvjitlink"] = f"{major}.{minor}"
    except Exception as e:  # no library: the daemon still serves status
        out["nvjitlink"] = f"unavailable ({type(e).__name__})"
    return out


# ---- HTTP ---------------------------------------------------------------------------------


class HttpError(Exception):
    def __init__(self, status: int, message: str, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.headers = headers or {}


@dataclass
class Request:
    method: str
    target: str
    path: str
    segments: list[str]
    headers: dict[str, str]
    body: bytes = b""


@dataclass
class Response:
    status: int
    body: bytes
    content_type: str = "application/json"
    headers: dict[str, str] = field(default_factory=dict)


def json_response(status: int, obj: dict[str, Any], headers: dict[str, str] | None = None) -> Response:
    return Response(status, (json.dumps(obj, default=str) + "\n").encode(), headers=headers or {})


def error_response(status: int, message: str, headers: dict[str, str] | None = None) -> Response:
    return json_response(status, {"ok": False, "error": message}, headers)


def reason(status: int) -> str:
    try:
        return http.HTTPStatus(status).phrase
    except ValueError:
        return "Unknown"


async def read_head(reader: asyncio.StreamReader) -> Request | None:
    """The request line and headers (None: the client closed without a request)."""
    try:
        line = await reader.readline()
    except ValueError:  # over the reader's limit
        raise HttpError(431, "request line too long") from None
    if not line:
        return None
    if not line.endswith(b"\n"):
        raise HttpError(400, "incomplete request line")
    parts = line.decode("latin-1").rstrip("\r\n").split(" ")
    if len(parts) != 3 or not parts[0] or not parts[1]:
        raise HttpError(400, "bad request line: expected METHOD TARGET HTTP/1.1")
    method, target, version = parts
    if not version.startswith("HTTP/1."):
        raise HttpError(505, f"{version}: only HTTP/1.x is served")
    headers: dict[str, str] = {}
    size = 0
    for _ in range(MAX_HEADERS + 1):
        try:
            h = await reader.readline()
        except ValueError:
            raise HttpError(431, "header line too long") from None
        if h in (b"\r\n", b"\n"):
            break
        if not h.endswith(b"\n"):
            raise HttpError(400, "incomplete headers")
        size += len(h)
        if size > MAX_HEAD:
            raise HttpError(431, f"headers over {MAX_HEAD} bytes")
        name, sep, value = h.decode("latin-1").partition(":")
        if not sep or not name or name != name.strip():
            raise HttpError(400, f"bad header line {h[:80]!r}")
        key, value = name.lower(), value.strip()
        if key == "content-length" and key in headers and headers[key] != value:
            raise HttpError(400, "conflicting Content-Length headers")
        headers[key] = value
    else:
        raise HttpError(431, f"more than {MAX_HEADERS} headers")
    if target.startswith(("http://", "https://")):
        try:
            target = urllib.parse.urlsplit(target).path or "/"
        except ValueError as e:  # e.g. "http://[": an unclosed IPv6 host
            raise HttpError(400, f"request target {target[:80]!r}: {e}") from None
    if not target.startswith("/"):
        raise HttpError(400, f"request target {target[:80]!r}: a path starting with / expected")
    path = target.split("?", 1)[0].split("#", 1)[0]
    raw = path[1:].split("/")
    if len(raw) > 1 and raw[-1] == "":
        raw.pop()  # one trailing slash
    try:
        segments = [urllib.parse.unquote(s, errors="strict") for s in raw]
    except UnicodeDecodeError:
        raise HttpError(400, f"path {path[:80]!r}: not UTF-8") from None
    return Request(method.upper(), target, path, segments, headers)


def content_length(req: Request) -> int:
    if "transfer-encoding" in req.headers:
        raise HttpError(411, "chunked bodies are not supported: send Content-Length")
    v = req.headers.get("content-length")
    if v is None:
        return 0
    if not (v.isascii() and v.isdigit()):  # str.isdigit() alone takes "²" (latin-1 superscripts) too
        raise HttpError(400, f"Content-Length {v[:40]!r}: not a number")
    n = int(v) if len(v) <= 20 else MAX_BODY + 1  # int() of thousands of digits raises: over the limit anyway
    if n > MAX_BODY:
        raise HttpError(413, f"body of {v[:40]} bytes is over the limit of {MAX_BODY} bytes (64 MiB)")
    return n


# ---- request bodies -----------------------------------------------------------------------


def json_body(req: Request) -> dict[str, Any]:
    """The body as a JSON object: strict JSON (``client.parse_json``), nested at most
    ``client.MAX_JSON_DEPTH`` (32) levels, checked without recursion before it is parsed."""
    if not req.body.strip():
        raise HttpError(400, "body: a JSON object expected, got an empty body")
    try:
        obj = parse_json(req.body)
    except ValueError as e:
        raise HttpError(400, f"body: not JSON: {e}") from None
    if not isinstance(obj, dict):
        raise HttpError(400, f"body: a JSON object expected, got {_jtype(obj)}")
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
            raise HttpError(400, f"unknown field {_show(k)} (expected {', '.join(allowed)})")


def check_name(name: str) -> str:
    if not NAME.fullmatch(name) or ".." in name:
        raise HttpError(400, f"program name {name[:80]!r}: {RULE}")
    return name


def _int_field(obj: dict[str, Any], key: str) -> int | None:
    v = obj.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int):
        raise HttpError(400, f"field {key!r}: an integer expected, got {_jtype(v)}")
    return v


@dataclass
class Image:
    """A load or upgrade request, checked."""

    manifest: Manifest
    text: str  # PTX
    expect: int | None
    nodes: int | None
    device: int | None = None


def parse_image(obj: dict[str, Any]) -> Image:
    """A load/upgrade body, checked whole.  Integers are bounded only by what they mean (a GPU
    ordinal must be served here, ``nodes`` must fit the GPU: Programs refuses more with 409)."""
    if "cuda" in obj:
        raise HttpError(400, PTX_ONLY)
    check_fields(obj, LOAD_FIELDS)
    if "manifest" not in obj:
        raise HttpError(400, "field 'manifest' is missing")
    raw = obj["manifest"]
    if isinstance(raw, str):  # a manifest's JSON text: read as strictly as the body
        try:
            raw = parse_json(raw)
        except ValueError as e:
            raise HttpError(400, f"field 'manifest': not JSON: {e}") from None
    if not isinstance(raw, dict):
        raise HttpError(400, f"field 'manifest': a JSON object expected, got {_jtype(raw)}")
    m = Manifest.parse(raw)  # ManifestError names the field: 400
    check_name(m.name)
    if "ptx" not in obj:
        raise HttpError(400, "field 'ptx' (the program's PTX text) is missing")
    text = obj["ptx"]
    if not isinstance(text, str):
        raise HttpError(400, f"field 'ptx': a string expected, got {_jtype(text)}")
    if not text.strip():
        raise HttpError(400, "field 'ptx' is empty")
    expect = None
    if obj.get("hash") is not None:
        h = obj["hash"]
        if not isinstance(h, str) or len(h) != 16 or any(c not in "0123456789abcdefABCDEF" for c in h):
            raise HttpError(400, f"field 'hash' {_show(h)}: 16 hex digits expected")
        expect = int(h, 16)
    nodes = _int_field(obj, "nodes")
    if nodes is not None and nodes < 1:
        raise HttpError(400, f"field 'nodes' {nodes}: at least 1")
    device = _int_field(obj, "device")
    if device is not None and device < 0:
        raise HttpError(400, f"field 'device' {device}: a GPU ordinal is 0 or more")
    return Image(m, text, expect, nodes, device)


# ---- the daemon ---------------------------------------------------------------------------


class Daemon:
    def __init__(self, cfg: Config):
        self.cfg = cfg
        self.socket_path = os.path.abspath(cfg.socket or default_socket())
        self.backend: Backend | None = None
        self.programs: Programs | None = None
        self.stopping = False
        self.signals: list[int] = []
        self._wake: asyncio.Event | None = None
        self._stop: asyncio.Event | None = None
        self._conns: set[asyncio.Task[Any]] = set()
        self._busy: set[asyncio.Task[Any]] = set()
        self._sock_id: tuple[int, int] | None = None
        self.t0 = time.monotonic()
        self.started = datetime.now(timezone.utc)
        self.versions: dict[str, str] = {}
        self.faults = 0
        self.deaths = 0
        self._seen: dict[tuple[str, float], str] = {}  # (name, start) -> last state seen
        self.http_codes: dict[int, int] = {}
        self.registry = Registry()
        self.load_seconds: Histogram | None = None

    # ---- lifecycle ------------------------------------------------------------------------
    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        self._wake, self._stop = asyncio.Event(), asyncio.Event()
        for s in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(s, self._on_signal, s)
        watcher = asyncio.create_task(self._watch_signals(), name="signals")
        monitor: asyncio.Task[None] | None = None
        server: asyncio.base_events.Server | None = None
        sock: socket.socket | None = None
        try:
            try:
                become_subreaper()  # orphans of ours (the MPS daemon's) are ours to reap
            except MeshError as e:
                log.warning(str(e))
            sock = self._bind()
            opening = asyncio.create_task(self._open(), name="open")
            stopped = asyncio.create_task(self._stop.wait())
            await asyncio.wait({opening, stopped}, return_when=asyncio.FIRST_COMPLETED)
            if not opening.done():
                log.info("stopped during start-up")
                opening.cancel()
                try:
                    await opening
                except (asyncio.CancelledError, Exception):
                    pass
                return 0
            stopped.cancel()
            opening.result()  # its error (NoDriver, MpsError, ...) ends the start
            server = await asyncio.start_unix_server(self._handle, sock=sock, limit=MAX_HEAD, start_serving=False,
                                                     backlog=BACKLOG)
            await server.start_serving()
            b = self.backend
            assert b is not None and b.caps is not None
            if len(b.devices) == 1:
                where = f"device {b.caps.name}"
            else:
                where = "devices " + ", ".join(f"{d}: {b.device_caps[d].name}" for d in b.devices)
            log.info(
                f"meshd-mps {self.versions.get('meshd-mps')} serves on {self.socket_path}: isolation {b.isolation},"
                f" gpu {b.gpu}, {where}",
                socket=self.socket_path, isolation=b.isolation, gpu=b.gpu, device=b.caps.name, devices=list(b.devices),
            )
            monitor = asyncio.create_task(self._monitor(), name="monitor")
            await self._stop.wait()
            await self._drain(server)
            return 0
        finally:
            with anyio.CancelScope(shield=True):
                if monitor is not None:
                    monitor.cancel()
                if server is not None:
                    server.close()
                elif sock is not None:
                    sock.close()
                await self._close_backend()
                self._remove_socket()
            for s in (signal.SIGTERM, signal.SIGINT):
                loop.remove_signal_handler(s)
            watcher.cancel()
            if server is not None:
                log.info("meshd-mps stopped")

    async def _open(self) -> None:
        c = self.cfg
        pool = c.pool if c.pool is not None else (2 if c.isolation == "mps" else 0)
        self.versions = await anyio.to_thread.run_sync(versions)
        b = await Backend.open(isolation=c.isolation, sms=c.sms, mps_dir=c.mps_dir, pool=pool,  # type: ignore[arg-type]
                               gpu=c.gpu, cache_dir=c.cache_dir, devices=c.devices)
        self.backend = b
        # stall_after only when given: Programs' own default (programs.STALL_S) otherwise.
        self.programs = Programs(b) if c.stall_after is None else Programs(b, stall_after=c.stall_after)
        self._register_metrics()

    async def _close_backend(self) -> None:
        if self.programs is not None:
            try:
                await self.programs.close()
            except Exception:
                log.error("closing the programs failed", traceback=traceback.format_exc())
        if self.backend is not None:
            await self.backend.close()

    async def _drain(self, server: asyncio.base_events.Server) -> None:
        """Stop accepting; requests being served get GRACE_S to finish, idle connections are closed."""
        self.stopping = True
        server.close()
        for t in list(self._conns - self._busy):
            t.cancel()
        if self._busy:
            log.info(f"shutdown: waiting up to {GRACE_S:g}s for {len(self._busy)} requests")
            _done, pending = await asyncio.wait(set(self._busy), timeout=GRACE_S)
            for t in pending:
                t.cancel()
        if self._conns:
            await asyncio.wait(set(self._conns), timeout=2.0)

    # ---- signals ----------------------------------------------------------------------------
    def _on_signal(self, sig: int) -> None:
        """Called by the loop: only records the signal."""
        self.signals.append(sig)
        assert self._wake is not None
        self._wake.set()

    async def _watch_signals(self) -> None:
        assert self._wake is not None and self._stop is not None
        handled = 0
        while True:
            await self._wake.wait()
            self._wake.clear()
            while handled < len(self.signals):
                sig = self.signals[handled]
                handled += 1
                if handled == 1:
                    log.info(f"{signal.Signals(sig).name}: shutting down (a second signal forces the exit)")
                    self._stop.set()
                else:
                    self._force_exit(sig)

    def _force_exit(self, sig: int) -> None:
        name = signal.Signals(sig).name
        kids = _descendants(os.getpid())
        log.error(f"{name} during shutdown: forcing the exit; killing {len(kids)} processes", pids=sorted(kids))
        for pid in kids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        _reap_all(within=3.0)
        self._remove_socket()
        b = self.backend
        if b is not None and b.daemon is not None and b.daemon.temporary:
            shutil.rmtree(b.daemon.dir, ignore_errors=True)
        log.error(f"meshd-mps exits on {name} (status {128 + sig})")
        sys.stderr.flush()
        os._exit(128 + sig)

    # ---- the socket -----------------------------------------------------------------------
    def _bind(self) -> socket.socket:
        path = self.socket_path
        if len(os.fsencode(path)) > SUN_PATH_MAX:
            raise StartError(f"--socket {path}: {len(os.fsencode(path))} bytes, AF_UNIX allows {SUN_PATH_MAX}")
        _check_socket_dir(os.path.dirname(path))
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            st = None
        if st is not None:
            if not stat.S_ISSOCK(st.st_mode):
                raise StartError(f"{path} exists and is not a socket; refusing to replace it")
            if _serves(path):
                raise StartError(f"another meshd-mps serves on {path}")
            os.unlink(path)
            log.info(f"replaced the stale socket {path}")
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old = os.umask(0o177)
        try:
            s.bind(path)
        except OSError as e:
            s.close()
            if e.errno == errno.EADDRINUSE:
                raise StartError(f"another meshd-mps serves on {path}") from None
            raise StartError(f"{path}: bind: {e.strerror}") from None
        finally:
            os.umask(old)
        os.chmod(path, 0o600)
        st = os.stat(path)
        self._sock_id = (st.st_dev, st.st_ino)
        s.listen(BACKLOG)  # a client that connects during start-up waits for the answer
        s.setblocking(False)
        return s

    def _remove_socket(self) -> None:
        if self._sock_id is None:
            return
        try:
            st = os.lstat(self.socket_path)
            if (st.st_dev, st.st_ino) == self._sock_id:
                os.unlink(self.socket_path)
        except FileNotFoundError:
            pass
        except OSError as e:
            log.error(f"{self.socket_path}: not removed: {e.strerror}")
        self._sock_id = None

    # ---- connections ------------------------------------------------------------------------
    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._conns.add(task)
        try:
            await self._serve_one(reader, writer)
        except (ConnectionError, asyncio.IncompleteReadError, asyncio.CancelledError):
            pass
        except Exception:
            log.error("connection failed", traceback=traceback.format_exc())
        finally:
            self._conns.discard(task)
            self._busy.discard(task)
            try:
                writer.close()
            except Exception:
                pass

    async def _serve_one(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        t0 = time.perf_counter()
        req: Request | None = None
        linger = False
        try:
            try:
                req = await asyncio.wait_for(read_head(reader), HEAD_S)
            except TimeoutError:
                raise HttpError(408, f"no request in {HEAD_S:g}s") from None
            if req is None:
                return
            try:
                n = content_length(req)
            except HttpError as e:
                linger = e.status == 413
                raise
            if n and req.headers.get("expect", "").lower() == "100-continue":
                writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
            try:
                req.body = await asyncio.wait_for(reader.readexactly(n), BODY_S) if n else b""
            except TimeoutError:
                raise HttpError(408, f"body not received in {BODY_S:g}s") from None
            if self.stopping:
                raise HttpError(503, "meshd-mps is shutting down")
            task = asyncio.current_task()
            assert task is not None
            self._busy.add(task)
            resp = await self._dispatch(req)
        except HttpError as e:
            resp = error_response(e.status, e.message, e.headers)
        except (ConnectionError, asyncio.IncompleteReadError):
            raise
        except Exception:  # a bug in reading the request: answered, not a dropped connection
            log.error("reading a request failed", traceback=traceback.format_exc())
            resp = error_response(500, "internal error (the daemon's log has the traceback)")
        self.http_codes[resp.status] = self.http_codes.get(resp.status, 0) + 1
        head = [f"HTTP/1.1 {resp.status} {reason(resp.status)}", f"Content-Type: {resp.content_type}",
                f"Content-Length: {len(resp.body)}", "Connection: close", "Server: meshd-mps"]
        head += [f"{k}: {v}" for k, v in resp.headers.items()]
        writer.write(("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + resp.body)
        await writer.drain()
        ms = (time.perf_counter() - t0) * 1e3
        what = f"{req.method} {req.path}" if req is not None else "-"
        log.debug(f"http {what} {resp.status}", ms=round(ms, 2))
        if linger:  # the client may still be sending the body: take it, so that it reads the 413
            writer.write_eof()
            with anyio.move_on_after(2.0):
                while await reader.read(1 << 20):
                    pass

    async def _dispatch(self, req: Request) -> Response:
        try:
            handler, args = self._route(req)
            return await handler(req, *args)
        except HttpError as e:
            return error_response(e.status, e.message, e.headers)
        except MeshError as e:
            status = status_of(e)
            if status >= 500:
                log.error(f"{req.method} {req.path}: {e}")
            return json_response(status, {"ok": False, "error": str(e), **e.fields()})
        except Exception:
            log.error(f"{req.method} {req.path}: internal error", traceback=traceback.format_exc())
            return error_response(500, "internal error (the daemon's log has the traceback)")

    def _route(self, req: Request) -> tuple[Callable[..., Awaitable[Response]], tuple[str, ...]]:
        seg = req.segments
        if any(s in (".", "..") for s in seg):
            raise HttpError(400, f"path {req.path[:80]!r}: '.' and '..' segments are refused")
        table: list[tuple[list[str | None], dict[str, Callable[..., Awaitable[Response]]]]] = [
            (["v1", "status"], {"GET": self.get_status}),
            (["v1", "programs"], {"GET": self.get_programs, "POST": self.post_program}),
            (["v1", "programs", None], {"GET": self.get_program, "PUT": self.put_program, "DELETE": self.delete_program}),
            (["v1", "programs", None, "call"], {"POST": self.post_call}),
            (["metrics"], {"GET": self.get_metrics}),
        ]
        for pattern, methods in table:
            if len(pattern) != len(seg) or any(p is not None and p != s for p, s in zip(pattern, seg)):
                continue
            args = tuple(check_name(s) for p, s in zip(pattern, seg) if p is None)
            h = methods.get(req.method)
            if h is None:
                allow = ", ".join(methods)
                raise HttpError(405, f"{req.method} {req.path}: method not allowed (allowed: {allow})", {"Allow": allow})
            return h, args
        raise HttpError(404, f"no route {req.method} {req.path[:200]}")

    # ---- routes -----------------------------------------------------------------------------
    def _p(self) -> Programs:
        if self.programs is None:
            raise HttpError(503, "meshd-mps is starting")
        return self.programs

    def _b(self) -> Backend:
        if self.backend is None:
            raise HttpError(503, "meshd-mps is starting")
        return self.backend

    def _describe(self, p: Program) -> dict[str, Any]:
        d = self._p().describe(p)
        d["worker_pid"] = d["pid"]
        d["started"] = datetime.fromtimestamp(p.started_wall, timezone.utc).isoformat()
        d["compile_ms"] = round(p.compile_ms, 3)
        d["cached"] = p.cached
        return d

    async def get_status(self, req: Request) -> Response:
        b, ps = self._b(), self._p()
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
            "pool": {"idle": s.get("pool", []), "capacity": s.get("pool_cap", 0)},
            "workers": s["workers"],
            "retired": s["retired"],
            "server_pid": None,
            "clients": None,
            "daemon_pid": s.get("daemon_pid"),
            "daemon_died": s.get("daemon_died"),
            "mps_dir": s.get("mps_dir"),
            "programs": len(ps.by_name),
            "stalled": sum(1 for p in ps.by_name.values() if ps.describe(p)["state"] == "stalled"),
            "devices": [{**d, "programs": len(ps.on_device(d["device"]))} for d in s["devices"]],
            "loads": ps.loads,
            "requests_in_flight": len(self._busy),  # this one included
            "faults": [_fault(f) for f in getattr(ps, "faults", [])[-10:]],
            "uptime_s": round(time.monotonic() - self.t0, 3),
            "started": self.started.isoformat(),
            "versions": self.versions,
        }
        if b.mps is not None:
            try:
                server = await b.mps.server_pid()
                out["server_pid"] = int(server) if server and server.isdigit() else server
                out["clients"] = await b.mps.clients(server) if server else []
            except MeshError as e:
                out["clients_error"] = str(e)
        else:
            out.update(blinks=s.get("blinks", 0), last_blink_ms=s.get("last_blink_ms"), context_pid=s.get("context_pid"))
        return json_response(200, out)

    async def get_programs(self, req: Request) -> Response:
        ps = self._p()
        self._scan()
        return json_response(200, {"ok": True, "programs": [self._describe(p) for p in sorted(ps.by_name.values(), key=lambda p: p.slot)]})

    async def get_program(self, req: Request, name: str) -> Response:
        return json_response(200, {"ok": True, "program": self._describe(self._p().get(name))})

    def _loaded(self, p: Program, status: int, what: str) -> Response:
        ps = self._p()
        if ps.load_ms and self.load_seconds is not None:
            self.load_seconds.observe(ps.load_ms[-1] / 1e3)
        return json_response(status, {"ok": True, what: p.name, "program": self._describe(p)})

    async def post_program(self, req: Request) -> Response:
        ps = self._p()
        img = parse_image(json_body(req))
        name = img.manifest.name
        if name in ps.by_name:
            raise HttpError(409, f"program {name!r} is already loaded (upgrade it with PUT /v1/programs/{name})")
        if img.device is not None and img.device not in self._b().devices:
            raise HttpError(400, f"field 'device' {img.device}: this daemon serves GPU"
                                 f" {', '.join(map(str, self._b().devices))} (--devices)")
        p = await ps.load(img.manifest, img.text.encode(), img.expect, img.nodes or 1, img.device)
        return self._loaded(p, 201, "loaded")

    async def put_program(self, req: Request, name: str) -> Response:
        ps = self._p()
        img = parse_image(json_body(req))
        if img.manifest.name != name:
            raise HttpError(400, f"upgrade {name}: the manifest names {img.manifest.name!r}")
        old = ps.get(name)  # 404
        if img.nodes is not None and img.nodes != old.nodes:
            raise HttpError(400, f"field 'nodes' {img.nodes}: an upgrade keeps the program's {old.nodes} (unload and load to change it)")
        if img.device is not None and img.device != old.device:
            raise HttpError(400, f"field 'device' {img.device}: an upgrade keeps the program on its GPU {old.device}"
                                 " (unload and load to move it)")
        p = await ps.upgrade(name, img.manifest, img.text.encode(), img.expect)
        return self._loaded(p, 200, "upgraded")

    async def delete_program(self, req: Request, name: str) -> Response:
        ps = self._p()
        p = ps.get(name)
        await ps.unload(name)
        return json_response(200, {"ok": True, "unloaded": name, "slot": p.slot})

    async def post_call(self, req: Request, name: str) -> Response:
        ps = self._p()
        obj = json_body(req)
        check_fields(obj, CALL_FIELDS)
        if ("data" in obj) == ("hex" in obj):
            raise HttpError(400, "one of the fields 'data' (text) or 'hex' (bytes in hex) is needed")
        if "data" in obj:
            if not isinstance(obj["data"], str):
                raise HttpError(400, f"field 'data': a string expected, got {_jtype(obj['data'])}")
            payload = obj["data"].encode()
        else:
            if not isinstance(obj["hex"], str):
                raise HttpError(400, f"field 'hex': a string expected, got {_jtype(obj['hex'])}")
            try:
                payload = bytes.fromhex(obj["hex"])
            except ValueError as e:
                raise HttpError(400, f"field 'hex': {e}") from None
        if len(payload) > abi.ENTRY_PAYLOAD:
            raise HttpError(400, f"request of {len(payload)} bytes: a ring entry holds at most {abi.ENTRY_PAYLOAD}")
        within = DEFAULT.call
        if obj.get("timeout") is not None:
            t = obj["timeout"]
            if isinstance(t, bool) or not isinstance(t, (int, float)) or not 0 < t <= MAX_CALL_S:
                raise HttpError(400, f"field 'timeout' {_show(t)}: seconds, more than 0 and at most {MAX_CALL_S:g}")
            within = float(t)
        ps.get(name)  # 404
        t0 = time.perf_counter()
        got = await ps.call(name, payload, within)
        return json_response(200, {"ok": True, "program": name, "data": got.decode("utf-8", "replace"), "hex": got.hex(),
                                   "bytes": len(got), "ms": round((time.perf_counter() - t0) * 1e3, 3)})

    async def get_metrics(self, req: Request) -> Response:
        self._scan()
        return Response(200, self.registry.render().encode(), METRICS_TYPE)

    # ---- program states, metrics ----------------------------------------------------------
    def _scan(self) -> None:
        """Count programs that failed or faulted since the last look (deaths: their worker died).
        Programs logs the failures itself; this only counts them, once each."""
        if self.programs is None:
            return
        current = {}
        for p in self.programs.by_name.values():
            key = (p.name, p.started)
            state, _error = p.state()
            current[key] = state
            before = self._seen.get(key)
            # Newly failed (failed -> faulted is one fault); any other state (running, exited,
            # stalled, ...) is not a failure.
            if state in FAILED and before not in FAILED:
                self.faults += 1
                f = p.launch.inner
                if f.done() and not f.cancelled() and isinstance(f.exception(), WorkerError):
                    self.deaths += 1
        self._seen = current

    async def _monitor(self) -> None:
        while True:
            await asyncio.sleep(MONITOR_S)
            try:
                self._scan()
            except Exception:
                log.error("monitor failed", traceback=traceback.format_exc())

    def _register_metrics(self) -> None:
        r, b, ps = self.registry, self.backend, self.programs
        assert b is not None and ps is not None and b.caps is not None
        caps = b.caps
        r.gauge("meshd_mps_info", "This daemon: version, isolation mode, GPU kind and device (always 1).",
                lambda: [({"version": self.versions.get("meshd-mps", ""), "isolation": b.isolation, "gpu": b.gpu,
                           "device": caps.name}, 1)])
        r.gauge("meshd_mps_uptime_seconds", "Seconds since the daemon started.", lambda: round(time.monotonic() - self.t0, 3))
        r.counter("meshd_mps_loads_total", "Successful loads and upgrades.", lambda: ps.loads)
        self.load_seconds = r.histogram(
            "meshd_mps_load_seconds", "Time of each successful load or upgrade (checks, JIT or cache, preload, launch).")

        def by_state() -> list[tuple[dict[str, str], float]]:
            n = dict.fromkeys(STATES, 0)
            for p in ps.by_name.values():
                st = ps.describe(p)["state"]  # "stalled" included (its heartbeat stopped)
                n[st] = n.get(st, 0) + 1
            return [({"state": k}, v) for k, v in n.items()]

        def beat_ages() -> list[tuple[dict[str, str], float]]:
            ages = [(p.name, ps.describe(p).get("beat_age_s")) for p in ps.by_name.values()]
            return [({"program": name}, age) for name, age in ages if age is not None]  # never beat: no sample

        r.gauge("meshd_mps_programs", "Loaded programs, by state.", by_state)
        r.counter("meshd_mps_faults_total", "Programs seen failed or faulted (a launch error, a GPU fault, a worker death).",
                  lambda: self.faults)
        r.counter("meshd_mps_gpu_faults_total", "GPU faults that took every MPS client down (MPS mode; each one recovered).",
                  lambda: sum(1 for f in getattr(ps, "faults", []) if getattr(f, "gpu_wide", False)))
        r.counter("meshd_mps_worker_deaths_total", "Programs that ended because their worker process died.", lambda: self.deaths)
        r.gauge("meshd_mps_workers", "Live worker processes (MPS clients, or the blink context).", lambda: len(b.sup.live()))
        r.counter("meshd_mps_workers_retired_total", "Worker processes retired and reaped (pool overflow, unfit, dead).",
                  lambda: b.sup.retired)
        r.gauge("meshd_mps_pool_idle", "Idle pooled workers, every GPU's (MPS mode).", lambda: b.mps.idle() if b.mps else 0)
        r.gauge("meshd_mps_pool_capacity", "The pools' capacity: --pool per GPU.",
                lambda: sum(p.cap for p in b.mps.pools.values()) if b.mps else 0)
        r.gauge("meshd_mps_device_info", "Each GPU served, by CUDA ordinal and name (always 1).",
                lambda: [({"device": str(d), "name": b.device_caps[d].name}, 1) for d in b.devices])
        r.gauge("meshd_mps_device_programs", "Loaded programs on each GPU.",
                lambda: [({"device": str(d)}, len(ps.on_device(d))) for d in b.devices])
        r.gauge("meshd_mps_device_pool_idle", "Idle pooled workers on each GPU (MPS mode).",
                lambda: [({"device": str(d)}, len(b.mps.pools[d]) if b.mps else 0) for d in b.devices])
        if b.blinks:
            r.counter("meshd_mps_blinks_total", "Blinks: module changes that halted and relaunched running programs.",
                      lambda: sum(c.blinks for c in b.blinks.values()))
            r.counter("meshd_mps_device_blinks_total", "Blinks on each GPU (each GPU's context blinks alone).",
                      lambda: [({"device": str(d)}, c.blinks) for d, c in sorted(b.blinks.items())])

            def last_blink() -> float | None:
                ms = b.last_blink_ms()
                return None if ms is None else ms / 1e3

            r.gauge("meshd_mps_last_blink_seconds", "Length of the last blink on any GPU (absent before the first).", last_blink)
        r.gauge("meshd_mps_program_heartbeat", "Each program's heartbeat counter (its mailbox slot's HEARTBEAT word).",
                lambda: [({"program": p.name}, b.mailbox.heartbeat(p.slot)) for p in ps.by_name.values()])
        r.gauge("meshd_mps_program_beat_age_seconds",
                "Seconds since each program's heartbeat was last seen advancing (no sample for one that never beat).",
                beat_ages)
        r.gauge("meshd_mps_sms", "SMs a program may use (--sms, else the device's).", lambda: caps.sms)
        r.counter("meshd_mps_http_requests_total", "Control API requests answered, by status code.",
                  lambda: [({"code": str(k)}, v) for k, v in sorted(self.http_codes.items())])


def _fault(f: Any) -> dict[str, Any]:
    """A FaultReport as JSON (its fields, the time in ISO 8601)."""
    d = dict(getattr(f, "__dict__", {}))
    if isinstance(d.get("at"), (int, float)):
        d["at"] = datetime.fromtimestamp(d["at"], timezone.utc).isoformat()
    return d


# ---- the socket's directory -------------------------------------------------------------------


def _check_socket_dir(d: str) -> None:
    """The socket's directory, created (0700) if it is missing, and refused (StartError) unless only
    the daemon's user can write it: a directory owned by the daemon's uid, or by root, with no group
    or other write bit, so that nobody else can remove, rename or replace the socket or plant
    another one in its place.  This holds for every socket (--socket, $MESHD_MPS_SOCKET, the
    defaults), with no exception for sticky directories such as /tmp.  A symlink is followed if it
    is the daemon's user's or root's.  The default directories the daemon makes itself
    (client.private_dirs: /run/meshd-mps for root, /tmp/meshd-mps-$UID) must be its own: owned by
    its uid, and never a symlink (anyone can create that name in /tmp first)."""
    me = os.geteuid()
    own = os.path.abspath(d) in private_dirs(me)
    hint = "put the socket in a directory only you can write (--socket), or remove it and let meshd-mps make it"
    try:
        os.makedirs(d, mode=0o700, exist_ok=True)
    except FileExistsError:
        pass  # not a directory (or a dangling symlink): said below
    except OSError as e:
        raise StartError(f"socket directory {d}: cannot create it: {e.strerror}") from None
    try:
        st = os.lstat(d)
        if stat.S_ISLNK(st.st_mode):
            if own:
                raise StartError(f"socket directory {d} is a symlink; refusing it (the default directory must be a real"
                                 f" one, owned by uid {me}, mode 0700: remove the link and meshd-mps makes it)")
            if st.st_uid not in (me, 0):
                raise StartError(f"socket directory {d} is a symlink owned by uid {st.st_uid}, not by this daemon's uid"
                                 f" {me} or root; refusing it: {hint}")
            st = os.stat(d)
    except FileNotFoundError:
        raise StartError(f"socket directory {d}: a dangling symlink; refusing it") from None
    except OSError as e:
        raise StartError(f"socket directory {d}: {e.strerror}") from None
    if not stat.S_ISDIR(st.st_mode):
        raise StartError(f"socket directory {d} is not a directory; refusing it")
    if st.st_uid != me and (own or st.st_uid != 0):
        raise StartError(f"socket directory {d} is owned by uid {st.st_uid}, not by this daemon's uid {me}; refusing it"
                         f" (its owner could replace the socket): {hint}")
    if st.st_mode & 0o022:
        who = " and ".join(w for w, bit in (("its group", 0o020), ("other users", 0o002)) if st.st_mode & bit)
        raise StartError(f"socket directory {d} is writable by {who} (mode {stat.S_IMODE(st.st_mode):04o}); refusing it"
                         f" (they could remove or replace the socket): {hint}")


# ---- processes ------------------------------------------------------------------------------


def _serves(path: str) -> bool:
    """Someone accepts connections on the socket ``path`` (a stale socket refuses them)."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(2.0)
    try:
        s.connect(path)
        return True
    except (ConnectionRefusedError, FileNotFoundError):
        return False
    except TimeoutError:
        return True  # a full backlog: it is alive
    except OSError as e:
        raise StartError(f"{path}: {e.strerror}; refusing to replace it") from None
    finally:
        s.close()


def _ppids() -> dict[int, int]:
    return {p.pid: p.ppid for p in processes()}


def _descendants(root: int) -> set[int]:
    kids: dict[int, list[int]] = {}
    for pid, ppid in _ppids().items():
        kids.setdefault(ppid, []).append(pid)
    out, todo = set(), [root]
    while todo:
        for c in kids.get(todo.pop(), []):
            if c not in out:
                out.add(c)
                todo.append(c)
    return out


def _reap_all(within: float) -> None:
    """Kill and reap every child (orphans re-parented to us, a subreaper, included) until none is left."""
    deadline = time.monotonic() + within
    me = os.getpid()
    while time.monotonic() < deadline:
        kids = [p for p, pp in _ppids().items() if pp == me]
        if not kids:
            return
        for p in kids:
            try:
                os.kill(p, signal.SIGKILL)
            except ProcessLookupError:
                pass
            try:
                os.waitpid(p, os.WNOHANG)
            except ChildProcessError:
                pass
        time.sleep(0.01)
