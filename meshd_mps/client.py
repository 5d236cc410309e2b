"""The control API's client: HTTP/1.1 + JSON over the daemon's Unix socket.

Standard library only (``http.client`` on an AF_UNIX socket), and light to
import: the CLI's client commands load nothing else of meshd-mps.
"""

from __future__ import annotations

import http.client
import json
import os
import socket
import urllib.parse
from pathlib import Path
from typing import Any

SOCKET_ENV = "MESHD_MPS_SOCKET"
#: The daemon refuses bodies over this (413); the client does not send them.
MAX_BODY = 64 << 20


def default_socket() -> str:
    """``$MESHD_MPS_SOCKET``, else ``$XDG_RUNTIME_DIR/meshd-mps.sock``, else ``/tmp/meshd-mps-$UID.sock``."""
    env = os.environ.get(SOCKET_ENV)
    if env:
        return env
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    if xdg:
        return os.path.join(xdg, "meshd-mps.sock")
    return f"/tmp/meshd-mps-{os.getuid()}.sock"


class ClientError(Exception):
    """The daemon refused a request (``status`` is its HTTP status) or could not be reached (0)."""

    def __init__(self, message: str, status: int = 0, body: dict[str, Any] | None = None):
        super().__init__(message)
        self.status = status
        self.body = body or {}


class NoDaemon(ClientError):
    """Nobody serves on the socket."""


class UnixHTTPConnection(http.client.HTTPConnection):
    """http.client over a Unix stream socket."""

    def __init__(self, path: str, timeout: float | None = None):
        super().__init__("localhost", timeout=timeout)
        self.unix_path = path

    def connect(self) -> None:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            if self.timeout is not None:
                s.settimeout(self.timeout)
            s.connect(self.unix_path)
        except BaseException:
            s.close()
            raise
        self.sock = s


def quote(name: str) -> str:
    """A program name as one URL path segment (a ``/`` in it stays inside the segment)."""
    return urllib.parse.quote(name, safe="")


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
            try:
                conn.request(method, path, body=body, headers=h)
            except (BrokenPipeError, ConnectionResetError):
                pass  # the daemon answered before reading it all (413): its answer is still there
            try:
                r = conn.getresponse()
                data = r.read()
            except (http.client.HTTPException, OSError) as e:
                if isinstance(e, TimeoutError) or isinstance(e, socket.timeout):
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
            ans = json.loads(data)
        except ValueError:
            raise ClientError(f"HTTP {status}: not JSON: {data[:200]!r}", status) from None
        if not isinstance(ans, dict):
            raise ClientError(f"HTTP {status}: a JSON object expected", status)
        if not ans.get("ok") or status >= 400:
            raise ClientError(str(ans.get("error") or f"HTTP {status}"), status, ans)
        return ans

    # ---- the API --------------------------------------------------------------------------
    def status(self) -> dict[str, Any]:
        return self.request("GET", "/v1/status")

    def programs(self) -> list[dict[str, Any]]:
        return self.request("GET", "/v1/programs")["programs"]

    def program(self, name: str) -> dict[str, Any]:
        return self.request("GET", f"/v1/programs/{quote(name)}")["program"]

    def load(self, body: dict[str, Any]) -> dict[str, Any]:
        """``body``: {"manifest": {...}, "ptx": text | "cuda": text, "hash"?: 16 hex, "nodes"?: N, "device"?: GPU}."""
        return self.request("POST", "/v1/programs", body)

    def upgrade(self, name: str, body: dict[str, Any]) -> dict[str, Any]:
        return self.request("PUT", f"/v1/programs/{quote(name)}", body)

    def unload(self, name: str) -> dict[str, Any]:
        return self.request("DELETE", f"/v1/programs/{quote(name)}")

    def call(self, name: str, data: bytes | str, timeout: float | None = None) -> dict[str, Any]:
        """A request through the program's ring; the answer has ``data`` (text) and ``hex``."""
        body: dict[str, Any] = {"data": data} if isinstance(data, str) else {"hex": data.hex()}
        if timeout is not None:
            body["timeout"] = timeout
        wait = None if timeout is None else max(self.timeout, timeout + 10)
        return self.request("POST", f"/v1/programs/{quote(name)}/call", body, timeout=wait)

    def metrics(self) -> str:
        status, _h, data = self.raw("GET", "/metrics")
        if status != 200:
            raise ClientError(f"/metrics: HTTP {status}", status)
        return data.decode()


# ---- program files --------------------------------------------------------------------------


def program_body(dir: str | None = None, manifest: str | None = None, ptx: str | None = None, cuda: str | None = None,
                 hash: str | None = None, nodes: int | None = None, device: int | None = None) -> dict[str, Any]:
    """A load/upgrade body from files: a program directory (manifest.json and one ``*.ptx``
    or ``*.cu``) or ``manifest`` with ``ptx`` or ``cuda``; ``device``: the GPU (a CUDA ordinal).
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
    try:
        mtext = mpath.read_text()
    except OSError as e:
        raise ClientError(f"{mpath}: {e.strerror or e}") from None
    try:
        mobj = json.loads(mtext)
    except ValueError as e:
        raise ClientError(f"{mpath}: not JSON: {e}") from None
    src = Path(ptx if ptx is not None else cuda)  # type: ignore[arg-type]
    try:
        text = src.read_bytes().decode("utf-8")
    except OSError as e:
        raise ClientError(f"{src}: {e.strerror or e}") from None
    except UnicodeDecodeError as e:
        raise ClientError(f"{src}: not UTF-8 text: {e}") from None
    body: dict[str, Any] = {"manifest": mobj, ("ptx" if ptx is not None else "cuda"): text}
    if hash is not None:
        body["hash"] = hash
    if nodes is not None:
        body["nodes"] = nodes
    if device is not None:
        body["device"] = device
    return body
