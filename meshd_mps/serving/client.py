"""The control API's client: HTTP/1.1 + JSON over the daemon's Unix socket.

Standard library only (``http.client`` on an AF_UNIX socket), and light to
import: the CLI's client commands load nothing else of meshd-mps, except
:mod:`meshd_mps.gpu.compiler` (and NVRTC) when a command compiles CUDA C.

The daemon takes PTX only: CUDA C is compiled here, by the client, with the
user's own rights (``#include`` reads the user's files, never the daemon's),
for the oldest GPU the daemon serves (its ``GET /v1/status``).

JSON read here and by the daemon goes through :func:`parse_json` (from
:mod:`meshd_mps.strictjson`, re-exported here for the CLI): at most
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
from collections.abc import Callable
from pathlib import Path
from typing import Any

# Re-exported (``X as X``): the CLI and its users read JSON through the client module.
from meshd_mps.strictjson import (
    MAX_INT_DIGITS as MAX_INT_DIGITS,
    MAX_JSON_DEPTH as MAX_JSON_DEPTH,
    JSONRefused as JSONRefused,
    json_deeper_than as json_deeper_than,
    parse_json,
)

SOCKET_ENV = "MESHD_MPS_SOCKET"
#: The daemon refuses bodies over this (413); the client does not send them.
MAX_BODY = 64 << 20
#: The default socket's directory for root (without $XDG_RUNTIME_DIR); the daemon creates it 0700.
RUN_DIR = "/run/meshd-mps"
#: Where other users' default socket directory, ``meshd-mps-$UID``, is made (0700, by the daemon).
TMP_ROOT = "/tmp"
SOCKET_NAME = "meshd-mps.sock"
#: The architecture CUDA C is compiled for when no daemon is asked (``program_body`` without ``arch``).
DEFAULT_ARCH = "compute_90"


def private_dirs(euid: int | None = None) -> tuple[str, ...]:
    """The default socket directories the daemon creates itself and accepts only as its own (0700,
    owned by its uid, not a symlink): ``/run/meshd-mps`` (root) and ``/tmp/meshd-mps-$UID``."""
    euid = os.geteuid() if euid is None else euid
    return (RUN_DIR,) if euid == 0 else (os.path.join(TMP_ROOT, f"meshd-mps-{euid}"),)


def default_socket() -> str:
    """``$MESHD_MPS_SOCKET``; else ``$XDG_RUNTIME_DIR/meshd-mps.sock``; else, for root,
    ``/run/meshd-mps/meshd-mps.sock``; else ``/tmp/meshd-mps-$UID/meshd-mps.sock``: always in a
    directory only its owner can write (the daemon checks, and creates the last two 0700)."""
    env = os.environ.get(SOCKET_ENV)
    if env:
        return env
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    if xdg:
        return os.path.join(xdg, SOCKET_NAME)
    return os.path.join(private_dirs()[0], SOCKET_NAME)


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
    def __init__(self, socket_path: str | None = None, timeout: float = 120.0):
        self.socket = socket_path or default_socket()
        self.timeout = timeout

    # ---- transport ----------------------------------------------------------------------
    def raw(self, method: str, path: str, body: bytes | None = None, headers: dict[str, str] | None = None,
            timeout: float | None = None) -> tuple[int, dict[str, str], bytes]:
        """One request: (status, headers with lower-case names, body bytes)."""
        conn = UnixHTTPConnection(self.socket, timeout=timeout or self.timeout)
        try:
            try:
                conn.connect()
            except (FileNotFoundError, ConnectionRefusedError) as e:
                raise NoDaemon(f"no daemon on {self.socket} (start one with: meshd-mps serve)") from e
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
        try:
            ans = parse_json(data, strict=False)
        except ValueError as e:
            raise ClientError(f"HTTP {status}: not JSON ({e}): {data[:200]!r}", status) from e
        if not isinstance(ans, dict):
            raise ClientError(f"HTTP {status}: a JSON object expected", status)
        if not ans.get("ok") or status >= 400:
            raise ClientError(str(ans.get("error") or f"HTTP {status}"), status, ans)
        return ans

    # ---- the API --------------------------------------------------------------------------
    def status(self) -> dict[str, Any]:
        return self.request("GET", "/v1/status")

    def arch(self) -> str:
        """The architecture to compile CUDA C for: ``compute_XY`` of the daemon's oldest GPU."""
        return oldest_arch(self.status())

    def program_body(self, *args: Any, **kw: Any) -> dict[str, Any]:
        """:func:`program_body`, CUDA C compiled for this daemon's oldest GPU (asked only if needed)."""
        kw.setdefault("arch", self.arch)
        return program_body(*args, **kw)

    def programs(self) -> list[dict[str, Any]]:
        return self.request("GET", "/v1/programs")["programs"]

    def program(self, name: str) -> dict[str, Any]:
        return self.request("GET", f"/v1/programs/{quote(name)}")["program"]

    def load(self, body: dict[str, Any]) -> dict[str, Any]:
        """``body``: {"manifest": {...}, "ptx": text, "hash"?: 16 hex, "nodes"?: N, "device"?: GPU,
        "restart"?: on-failure | always | never}
        (the daemon takes PTX only: see :func:`program_body` for CUDA C)."""
        return self.request("POST", "/v1/programs", body)

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

    def metrics(self) -> str:
        status, _h, data = self.raw("GET", "/metrics")
        if status != 200:
            raise ClientError(f"/metrics: HTTP {status}", status)
        return data.decode()


# ---- program files --------------------------------------------------------------------------


def compile_cuda(source: bytes, name: str, arch: str, include: list[str] | None = None) -> str:
    """CUDA C -> PTX text here, in this process (NVRTC, with the caller's own file access; the
    examples' ``mesh_program.h`` on the include path): ClientError with NVRTC's log, never a
    traceback."""
    try:
        from meshd_mps.errors import CompileError
        from meshd_mps.gpu.compiler import cuda_to_ptx
    except ImportError as e:
        raise ClientError(f"{name}: compiling CUDA C needs meshd-mps's compiler: {e}") from e
    try:
        ptx = cuda_to_ptx(source, name, arch, include)
    except CompileError as e:
        raise ClientError(str(e)) from e
    except ImportError as e:  # cuda.bindings is imported by the call
        raise ClientError(f"{name}: compiling CUDA C needs NVRTC (the cuda-bindings package): {e}") from e
    except Exception as e:  # NVRTC's library missing or broken: said in one line, not a traceback
        raise ClientError(f"{name}: NVRTC failed: {type(e).__name__}: {e}") from e
    try:
        return ptx.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ClientError(f"{name}: NVRTC's PTX is not UTF-8 text: {e}") from e


#: The most a program file read here may hold: the daemon's whole request body (64 MiB).
MAX_FILE = 64 << 20


def read_file(path: Path) -> bytes:
    """A regular file's bytes, at most MAX_FILE; ClientError otherwise (a device such as /dev/zero
    would be read without end, a FIFO would wait for a writer)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)  # a FIFO's open would wait
    except OSError as e:
        raise ClientError(f"{path}: {e.strerror or e}") from e
    with open(fd, "rb", buffering=0) as f:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ClientError(f"{path}: not a regular file")
        if st.st_size > MAX_FILE:
            raise ClientError(f"{path}: {st.st_size} bytes, over the limit of {MAX_FILE} (64 MiB)")
        try:
            return f.read(MAX_FILE)
        except OSError as e:
            raise ClientError(f"{path}: {e.strerror or e}") from e


def program_body(dir: str | None = None, manifest: str | None = None, ptx: str | None = None, cuda: str | None = None,
                 hash: str | None = None, nodes: int | None = None, device: int | None = None,
                 arch: str | Callable[[], str] | None = None, restart: str | None = None) -> dict[str, Any]:
    """A load/upgrade body from files: a program directory (manifest.json and one ``*.ptx``
    or ``*.cu``) or ``manifest`` with ``ptx`` or ``cuda``; ``device``: the GPU (a CUDA ordinal);
    ``restart``: its restart policy (on-failure, always, never; the daemon checks it).
    The body always carries PTX: CUDA C is compiled here (:func:`compile_cuda`, the source's own
    directory on the include path) for ``arch`` (``compute_XY``, or a function that returns it,
    called only then, e.g. :meth:`Client.arch`; default ``DEFAULT_ARCH``).
    ClientError says what is wrong."""
    if dir is not None:
        d = Path(dir)
        if not d.is_dir():
            raise ClientError(f"{dir}: not a directory")
        mpath = Path(manifest) if manifest else d / "manifest.json"
        if ptx is None and cuda is None:
            ptxs, cus = sorted(d.glob("*.ptx")), sorted(d.glob("*.cu"))
            if len(ptxs) == 1:
                ptx = str(ptxs[0])
            elif len(ptxs) > 1:
                raise ClientError(f"{dir}: {len(ptxs)} .ptx files; name one with --ptx")
            elif len(cus) == 1:
                cuda = str(cus[0])
            elif len(cus) > 1:
                raise ClientError(f"{dir}: {len(cus)} .cu files; name one with --cuda")
            else:
                raise ClientError(f"{dir}: no .ptx or .cu file")
    elif manifest is not None:
        mpath = Path(manifest)
    else:
        raise ClientError("a program directory or --manifest FILE is needed")
    if (ptx is None) == (cuda is None):
        raise ClientError("one of --ptx FILE or --cuda FILE is needed")
    mtext = read_file(mpath)
    try:
        mobj = parse_json(mtext)
    except ValueError as e:
        raise ClientError(f"{mpath}: not JSON: {e}") from e
    src = Path(ptx if ptx is not None else cuda)  # type: ignore[arg-type]
    raw = read_file(src)
    if ptx is not None:
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise ClientError(f"{src}: not UTF-8 text: {e}") from e
    else:
        given = mobj.get("name") if isinstance(mobj, dict) else None
        name = given if isinstance(given, str) else src.stem
        target = arch() if callable(arch) else (arch or DEFAULT_ARCH)
        text = compile_cuda(raw, name, target, [str(src.resolve().parent)])
    body: dict[str, Any] = {"manifest": mobj, "ptx": text}
    if hash is not None:
        body["hash"] = hash
    if nodes is not None:
        body["nodes"] = nodes
    if device is not None:
        body["device"] = device
    if restart is not None:
        body["restart"] = restart
    return body
