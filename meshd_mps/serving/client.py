"""The control API's client: HTTP/1.1 + JSON over the daemon's Unix socket.

Standard library only (``http.client`` on an AF_UNIX socket), and light to
import: the CLI's client commands load nothing else of meshd-mps, except
:mod:`meshd_mps.gpu.compiler` (and NVRTC) when a command compiles CUDA C.

The daemon takes PTX only: CUDA C is compiled here, by the client, with the
user's own rights (``#include`` reads the user's files, never the daemon's),
for the oldest GPU the daemon serves (its ``GET /v1/status``).

JSON read here and by the daemon goes through :func:`parse_json` (from
:mod:`meshd_mps.base.strictjson`, re-exported here for the CLI): at most
``MAX_JSON_DEPTH`` levels of nesting, checked by a scan before ``json.loads``
runs (so that it never recurses deeply).
"""

from __future__ import annotations

import contextlib
import http.client
import json
import math
import os
import socket
import stat
import struct
import urllib.parse
from typing import Any

from meshd_mps.base import defaults
from meshd_mps.base.errors import AlreadyLoaded

# Re-exported (``X as X``): the CLI and its users read JSON through the client module.
from meshd_mps.base.strictjson import (
    MAX_INT_DIGITS as MAX_INT_DIGITS,
    MAX_JSON_DEPTH as MAX_JSON_DEPTH,
    JSONRefused as JSONRefused,
    json_deeper_than as json_deeper_than,
    parse_json,
)

# Re-exported (``X as X``): the program files' reader (state/program_files.py), as the CLI used it here.
from meshd_mps.state.program_files import (
    DEFAULT_ARCH as DEFAULT_ARCH,
    MAX_FILE as MAX_FILE,
    ProgramFilesError,
    compile_cuda as compile_cuda,
    program_body,
    read_file as read_file,
)

#: ``$MESHD_MPS_SOCKET``, named in meshd_mps/base/defaults.py.
SOCKET_ENV = defaults.SOCKET_ENV
#: The daemon refuses bodies over this (413); the client does not send them.
MAX_BODY = 64 << 20
#: The content type of a call in the binary form, and of its answer (serving/schemas.py says it too).
BINARY = "application/octet-stream"
#: The default socket's directory for root (without $XDG_RUNTIME_DIR); the daemon creates it 0700.
RUN_DIR = "/run/meshd-mps"
#: Where other users' default socket directory, ``meshd-mps-$UID``, is made (0700, by the daemon).
TMP_ROOT = "/tmp"
SOCKET_NAME = f"{defaults.NAME}.sock"


def private_dirs(euid: int | None = None) -> tuple[str, ...]:
    """The default socket directories the daemon creates itself and accepts only as its own (0700,
    owned by its uid, not a symlink): ``/run/meshd-mps`` (root) and ``/tmp/meshd-mps-$UID``."""
    euid = os.geteuid() if euid is None else euid
    return (RUN_DIR,) if euid == 0 else (os.path.join(TMP_ROOT, f"meshd-mps-{euid}"),)


def default_socket(gpu: str | None = None) -> str:
    """``$MESHD_MPS_SOCKET``; else ``$XDG_RUNTIME_DIR/meshd-mps.sock``; else, for root,
    ``/run/meshd-mps/meshd-mps.sock``; else ``/tmp/meshd-mps-$UID/meshd-mps.sock``: always in a
    directory only its owner can write (the daemon checks, and creates the last two 0700).  For
    ``gpu="sim"`` the name is ``meshd-mps-sim.sock`` (defaults.named): the simulation's own."""
    env = os.environ.get(SOCKET_ENV)
    if env:
        return env
    return own_socket(gpu)


def own_socket(gpu: str | None = None) -> str:
    """The default socket of a daemon on ``gpu`` when ``$MESHD_MPS_SOCKET`` is not set."""
    name = f"{defaults.named(gpu)}.sock"
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    if xdg:
        return os.path.join(xdg, name)
    return os.path.join(private_dirs()[0], name)


def client_socket(given: str | None, config_socket: str | None = None, gpu: str | None = None) -> str:
    """The socket a client command talks to: ``--socket``, else ``$MESHD_MPS_SOCKET``, else the
    ``--config`` file's ``socket``, else the default of a daemon on ``gpu`` (``--gpu``)."""
    return given or os.environ.get(SOCKET_ENV) or config_socket or own_socket(gpu)


# ---- the client ---------------------------------------------------------------------------------


class ClientError(Exception):
    """The daemon refused a request (``status`` is its HTTP status) or could not be reached (0)."""

    def __init__(self, message: str, status: int = 0, body: dict[str, Any] | None = None):
        super().__init__(message)
        self.status = status
        self.body = body or {}


class NoDaemon(ClientError):
    """Nobody serves on the socket."""


def check_socket_owner(path: str) -> None:
    """Before connecting: ClientError if the socket ``path`` (or, for a symlink, the link or what it
    points to) belongs to another user than ours: a daemon of someone else, or an impostor that
    wants our requests.  A missing path is left to ``connect`` (NoDaemon)."""
    me = os.geteuid()
    try:
        st = os.lstat(path)
        target = os.stat(path) if stat.S_ISLNK(st.st_mode) else st
    except OSError:
        return
    if st.st_uid != me:
        raise ClientError(f"{path}: owned by uid {st.st_uid}, not by you (uid {me}); refusing to talk to it"
                          " (run the client as the daemon's user)")
    if target.st_uid != me:
        raise ClientError(f"{path}: a symlink to {os.path.realpath(path)}, owned by uid {target.st_uid}, not by you"
                          f" (uid {me}); refusing to talk to it (run the client as the daemon's user)")


def check_peer(s: socket.socket, path: str) -> None:
    """After connecting: the process that listens (SO_PEERCRED, Linux) runs as our uid."""
    if not hasattr(socket, "SO_PEERCRED"):
        return
    fmt = "iII"  # struct ucred: pid_t, uid_t, gid_t
    pid, uid, _gid = struct.unpack(fmt, s.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize(fmt)))
    me = os.geteuid()
    if uid != me:
        raise ClientError(f"{path}: served by pid {pid} as uid {uid}, not by you (uid {me}); refusing to talk to it"
                          " (run the client as the daemon's user)")


class UnixHTTPConnection(http.client.HTTPConnection):
    """http.client over a Unix stream socket whose owner and server are the caller's own uid."""

    def __init__(self, path: str, timeout: float | None = None):
        super().__init__("localhost", timeout=timeout)
        self.unix_path = path

    def connect(self) -> None:
        check_socket_owner(self.unix_path)
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            if self.timeout is not None:
                s.settimeout(self.timeout)
            s.connect(self.unix_path)
            check_peer(s, self.unix_path)
        except BaseException:
            s.close()
            raise
        self.sock = s


def quote(name: str) -> str:
    """A program name as one URL path segment (a ``/`` in it stays inside the segment); ClientError
    for one that is not text (a shell's undecodable bytes arrive as surrogates)."""
    try:
        return urllib.parse.quote(name, safe="")
    except UnicodeEncodeError as e:
        raise ClientError(f"program name {name!r}: not UTF-8 text") from e


def oldest_arch(status: dict[str, Any]) -> str:
    """``compute_XY`` of the oldest GPU a daemon's status names (its ``devices``' caps, else its
    ``caps``): PTX for it JITs on every GPU the daemon serves, whichever one takes the program."""
    caps = [d.get("caps") for d in status.get("devices") or [] if isinstance(d, dict)] or [status.get("caps")]
    ccs = [(c["cc_major"], c["cc_minor"]) for c in caps if isinstance(c, dict)
           and all(isinstance(c.get(k), int) and not isinstance(c.get(k), bool) for k in ("cc_major", "cc_minor"))]
    if not ccs:
        raise ClientError("the daemon's status names no compute capability (caps: cc_major, cc_minor), so CUDA C"
                          " cannot be compiled for its GPUs here; compile it to PTX and load it with --ptx")
    major, minor = min(ccs)
    return f"compute_{major}{minor}"


class Client:
    def __init__(self, socket_path: str | None = None, timeout: float = 120.0, gpu: str | None = None):
        """``gpu``: the kind of daemon meant (``"sim"``), for the advice when none answers."""
        self.socket = socket_path or default_socket(gpu)
        self.serve = "meshd-mps serve --gpu sim" if gpu == "sim" else "meshd-mps serve"
        self.timeout = timeout

    # ---- transport ----------------------------------------------------------------------
    def raw(self, method: str, path: str, body: bytes | None = None, headers: dict[str, str] | None = None,
            timeout: float | None = None) -> tuple[int, dict[str, str], bytes]:
        """One request: (status, headers with lower-case names, body bytes)."""
        conn = UnixHTTPConnection(self.socket, timeout=timeout or self.timeout)
        conn.blocksize = 1 << 20  # a file body (program data) is sent a MiB at a time
        try:
            try:
                conn.connect()
            except (FileNotFoundError, ConnectionRefusedError) as e:
                raise NoDaemon(f"no daemon on {self.socket} (start one with: {self.serve})") from e
            except OSError as e:
                raise ClientError(f"{self.socket}: {e.strerror or e}") from e
            h = {"Host": "meshd-mps", "Connection": "close", **(headers or {})}
            if body is not None:
                h.setdefault("Content-Type", "application/json")
            # the daemon answered before reading it all (413): its answer is still there
            with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                conn.request(method, path, body=body, headers=h)
            try:
                r = conn.getresponse()
                data = r.read()
            except (http.client.HTTPException, OSError) as e:
                if isinstance(e, (TimeoutError, socket.timeout)):
                    raise ClientError(f"{self.socket}: no answer in {timeout or self.timeout:g}s") from e
                raise ClientError(f"{self.socket}: {type(e).__name__}: {e}") from e
            return r.status, {k.lower(): v for k, v in r.getheaders()}, data
        finally:
            conn.close()

    def request(self, method: str, path: str, obj: dict[str, Any] | None = None, timeout: float | None = None) -> dict[str, Any]:
        """A JSON request; the JSON answer if ``ok``, else ClientError with the daemon's error."""
        body = None if obj is None else json.dumps(obj).encode()
        status, _headers, data = self.raw(method, path, body, timeout=timeout)
        return self._answer(status, data)

    # ---- the API --------------------------------------------------------------------------
    def status(self) -> dict[str, Any]:
        return self.request("GET", "/v1/status")

    def arch(self) -> str:
        """The architecture to compile CUDA C for: ``compute_XY`` of the daemon's oldest GPU."""
        return oldest_arch(self.status())

    def program_body(self, *args: Any, loading: bool = False, **kw: Any) -> dict[str, Any]:
        """:func:`program_body`, CUDA C compiled for this daemon's oldest GPU (asked only if needed);
        ``loading``: for a load, whose name is refused before the compile if it is loaded already."""
        kw.setdefault("arch", self.arch)
        if loading:
            kw.setdefault("check", self.check_not_loaded)
        try:
            return program_body(*args, **kw)
        except ProgramFilesError as e:  # the CLI's errors are ClientErrors, said as they were
            raise ClientError(str(e)) from e

    def check_not_loaded(self, name: str) -> None:
        """ClientError (the daemon's AlreadyLoaded, 409) if program ``name`` is loaded: asked before
        a load compiles CUDA C, which takes longer than the answer (the daemon checks again)."""
        try:
            self.program(name)
        except ClientError as e:
            if e.status == 404:
                return
            raise
        e2 = AlreadyLoaded(name)
        raise ClientError(str(e2), 409, {"ok": False, **e2.fields(), "error": str(e2)})

    def programs(self) -> list[dict[str, Any]]:
        return self.request("GET", "/v1/programs")["programs"]

    def program(self, name: str) -> dict[str, Any]:
        return self.request("GET", f"/v1/programs/{quote(name)}")["program"]

    def load(self, body: dict[str, Any]) -> dict[str, Any]:
        """``body``: {"manifest": {...}, "ptx": text, "hash"?: 16 hex, "nodes"?: N, "device"?: GPU,
        "restart"?: on-failure | always | never, "restore"?: reload | adopt, "lease_until"?: epoch seconds}
        (the daemon takes PTX only: see :func:`program_body` for CUDA C)."""
        return self.request("POST", "/v1/programs", body)

    def renew(self, names: list[str], until: float) -> dict[str, Any]:
        """The leases of programs ``names`` held until ``until`` (epoch seconds): ``renewed`` and
        ``missing`` (not loaded, or loaded without a lease)."""
        return self.request("POST", "/v1/leases", {"until": until, "programs": names})

    def upgrade(self, name: str, body: dict[str, Any]) -> dict[str, Any]:
        return self.request("PUT", f"/v1/programs/{quote(name)}", body)

    def unload(self, name: str) -> dict[str, Any]:
        return self.request("DELETE", f"/v1/programs/{quote(name)}")

    def native(self, add: int | None = None, drop: int | None = None) -> dict[str, Any]:
        """The native-client environment and registrations; with ``add``/``drop``, register or drop a pid."""
        if add is not None:
            return self.request("POST", "/v1/native", {"pid": add})
        if drop is not None:
            return self.request("DELETE", f"/v1/native/{drop}")
        return self.request("GET", "/v1/native")

    def call(self, name: str, data: bytes | str, timeout: float | None = None) -> dict[str, Any]:
        """A request through the program's ring; the answer has ``data`` (text) and ``hex``."""
        body: dict[str, Any] = {"data": data} if isinstance(data, str) else {"hex": data.hex()}
        if timeout is not None:
            if not 0 < timeout < math.inf:  # NaN too; the daemon says how long it waits at most
                raise ClientError(f"timeout {timeout:g}: seconds, a finite number more than 0")
            body["timeout"] = timeout
        wait = None if timeout is None else max(self.timeout, timeout + 10)
        return self.request("POST", f"/v1/programs/{quote(name)}/call", body, timeout=wait)

    def call_bytes(self, name: str, payload: bytes, timeout: float | None = None) -> bytes:
        """A request through the program's ring in the binary form (the body is the payload, the
        answer the response's bytes): any size the program declares, up to ``MAX_BODY``."""
        path = f"/v1/programs/{quote(name)}/call"
        if timeout is not None:
            if not 0 < timeout < math.inf:
                raise ClientError(f"timeout {timeout:g}: seconds, a finite number more than 0")
            path += f"?timeout={timeout!r}"
        if len(payload) > MAX_BODY:
            raise ClientError(f"request of {len(payload)} bytes: the daemon takes bodies of at most {MAX_BODY} (64 MiB)")
        wait = None if timeout is None else max(self.timeout, timeout + 10)
        status, headers, data = self.raw("POST", path, payload, {"Content-Type": BINARY}, timeout=wait)
        if status == 200 and headers.get("content-type", "").split(";")[0].strip() == BINARY:
            return data
        ans = self._answer(status, data)  # a refusal (raised here), or not the binary form's answer
        raise ClientError(f"HTTP {status}: JSON where the response's bytes were expected", status, ans)

    # ---- a program's data (docs/program-abi.md, "Data"; docs/api.md) ----------------------------------
    def upload(self, path: str) -> str:
        """The file ``path`` sent to the daemon (read here, as you, and streamed: neither side holds
        it whole), which keeps it by its SHA-256; that key, for a load's or upgrade's ``data``."""
        try:
            f = open(path, "rb")  # noqa: SIM115 - closed below, after the request that streams it
        except OSError as e:
            raise ClientError(f"data {path}: {e.strerror or e}") from e
        with f:
            size = os.fstat(f.fileno()).st_size
            if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
                raise ClientError(f"data {path}: not a regular file")
            return self.upload_bytes(f, size)  # type: ignore[arg-type]

    def upload_bytes(self, data: bytes | memoryview, size: int | None = None) -> str:
        """Data in memory (or a file object of ``size`` bytes) sent as ``upload`` sends a file: its key."""
        n = len(data) if size is None else size
        status, _h, ans = self.raw("POST", "/v1/data", data, {"Content-Type": "application/octet-stream",  # type: ignore[arg-type]
                                                             "Content-Length": str(n)})
        return str(self._answer(status, ans)["data"])

    def with_data(self, body: dict[str, Any], data: str | None, dir: str | None = None,
                  manifest: str | None = None) -> dict[str, Any]:
        """A load or upgrade ``body`` with its data: the file ``data``, else the manifest's own
        ``data`` file beside it (``DIR/manifest.json`` or ``manifest``), sent first (``upload``)."""
        if data is None:
            mname = body.get("manifest", {}).get("data") if isinstance(body.get("manifest"), dict) else None
            if mname:
                base = os.path.dirname(manifest) if manifest else (dir or ".")
                data = os.path.join(base, mname)
        if data is not None:
            body["data"] = self.upload(data)
        return body

    def write(self, name: str, offset: int, data: bytes) -> dict[str, Any]:
        """``data`` into the program's data at ``offset``, while it runs; the answer's ``seq`` is
        the slot's DATA_SEQ after it (None: placed at the program's next launch)."""
        status, _h, raw = self.raw("POST", f"/v1/programs/{quote(name)}/write?offset={int(offset)}", data,
                                   {"Content-Type": "application/octet-stream"})
        return self._answer(status, raw)

    def _answer(self, status: int, data: bytes) -> dict[str, Any]:
        """A JSON answer: itself if ``ok``, else ClientError with the daemon's error."""
        try:
            ans = parse_json(data, strict=False)
        except ValueError as e:
            raise ClientError(f"HTTP {status}: not JSON ({e}): {data[:200]!r}", status) from e
        if not isinstance(ans, dict):
            raise ClientError(f"HTTP {status}: a JSON object expected", status)
        if not ans.get("ok") or status >= 400:
            raise ClientError(str(ans.get("error") or f"HTTP {status}"), status, ans)
        return ans

    def metrics(self) -> str:
        status, _h, data = self.raw("GET", "/metrics")
        if status != 200:
            raise ClientError(f"/metrics: HTTP {status}", status)
        return data.decode()


def read_input(path: str) -> bytes:
    """A file's bytes (``-``: stdin's), at most MAX_BODY; ClientError otherwise."""
    import sys

    try:
        if path == "-":
            data = sys.stdin.buffer.read(MAX_BODY + 1)
        else:
            with open(path, "rb") as f:
                data = f.read(MAX_BODY + 1)
    except OSError as e:
        raise ClientError(f"{path}: {e.strerror or e}") from e
    if len(data) > MAX_BODY:
        raise ClientError(f"{path}: over the limit of {MAX_BODY} bytes (64 MiB) a body may have")
    return data
