"""``serve --metrics-address HOST:PORT``: ``GET /metrics`` over TCP, as Prometheus exporters serve
it, so that a Prometheus scrapes the daemon without a relay to its Unix socket (socat).

Off by default; a bare port is 127.0.0.1's (state/config.py, ``metrics_address``): the metrics say
what runs where, which is the host's business unless the operator opens it.  It serves the metrics
and nothing else (no control route: those stay on the 0600 socket), read-only, from the same
registry as the socket's ``/metrics`` (serving/metrics.py).  The port is bound at the start, before
the backend opens (as the control socket is), so that a port in use stops the start before
anything runs; it answers once the daemon serves, and is closed with the control API.
"""

from __future__ import annotations

import socket

from aiohttp import web

from meshd_mps.serving.metrics import CONTENT_TYPE, Metrics
from meshd_mps.serving.unix_socket import BACKLOG, StartError

PATH = "/metrics"
#: What ``GET /`` says, as exporters' landing pages do: where the metrics are.
LANDING = f"meshd-mps: the daemon's metrics are at {PATH}\n"


class Exporter:
    """The TCP listener of ``(host, port)``: :meth:`bind` at the start, :meth:`serve` once the
    metrics exist, :meth:`close` at the stop (each once; close also after a bind alone)."""

    def __init__(self, address: tuple[str, int]):
        self.host, self.port = address
        self.sock: socket.socket | None = None
        self.runner: web.AppRunner | None = None

    @property
    def where(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"

    def bind(self) -> None:
        """The port bound and listened on (a scrape that comes before the daemon serves waits);
        StartError naming the address (in use, not this host's, a name that does not resolve)."""
        try:
            family, kind, proto, _, addr = socket.getaddrinfo(self.host, self.port, type=socket.SOCK_STREAM)[0]
        except socket.gaierror as e:
            raise StartError(f"--metrics-address {self.where}: {e.strerror}") from e
        s = socket.socket(family, kind, proto)
        try:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a restart takes the port at once
            s.bind(addr)
            s.listen(BACKLOG)
        except OSError as e:
            s.close()
            raise StartError(f"--metrics-address {self.where}: bind: {e.strerror}") from e
        s.setblocking(False)
        self.sock = s
        self.port = s.getsockname()[1]  # port 0: the one the kernel chose

    async def serve(self, metrics: Metrics) -> None:
        """``GET /metrics`` answered from ``metrics`` on the bound port."""
        assert self.sock is not None

        async def scrape(request: web.Request) -> web.Response:
            return web.Response(body=metrics.exposition(), headers={"Content-Type": CONTENT_TYPE, "Server": "meshd-mps"})

        async def landing(request: web.Request) -> web.Response:
            return web.Response(text=LANDING, headers={"Server": "meshd-mps"})

        app = web.Application()
        app.router.add_get(PATH, scrape, allow_head=False)
        app.router.add_get("/", landing, allow_head=False)
        self.runner = web.AppRunner(app, access_log=None, handle_signals=False)
        await self.runner.setup()
        await web.SockSite(self.runner, self.sock).start()

    async def close(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()
            self.runner = None
        if self.sock is not None:
            self.sock.close()
            self.sock = None
