"""The node agent: a Ray actor per node that makes its node's daemon run that node's share of the
fleet, and nothing more of the fleet's.

The daemon keeps the programs (``meshd-mps serve --live-restore``, started by systemd, a DaemonSet
or the tests, never by Ray, so that no Ray process is its parent): the agent holds no program and
no process.  It is level-triggered: each share the controller sends replaces the last, and its own
loop compares it with the daemon's ``ps`` and closes the difference (load what is missing, upgrade
what runs another image, unload a ``fleet.*`` program the share no longer holds: a replica Ray
moved away while this node was gone).  A restarted agent starts with no share and touches nothing
until the controller sends one: what runs is adopted by being found running.  Every replica is
loaded with restore ``adopt`` (restore.py): a daemon that restarts adopts it while it runs, and
never loads it again by itself (a node lost and back would run a replica Ray re-placed meanwhile).
It loads and unloads only while its fleet holds the daemon's claim (claim.py), renewed at each
look: another fleet's daemon it leaves as it is, and says why (``observe``'s ``claim``).

It talks to the daemon through ``serving/client.Client`` (blocking, stdlib HTTP over the Unix
socket) in threads of its own, so that calls in flight and a reconcile share no thread.  Calls
from other nodes come to it as Ray actor calls (``call``) or, without the Ray hop, on its call port
(callport.py), opened at its first look and reported with it (``observe``'s ``call_port``).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import os
import time
from collections.abc import Callable, Collection
from typing import Any, TypeVar

import ray

from meshd_mps import errors as E
from meshd_mps.deadlines import DEFAULT, Deadlines
from meshd_mps.fleet import callport, claim
from meshd_mps.fleet.nodecalls import NodeAnswer, NodeCalls
from meshd_mps.fleet.spec import gpu_model, parse_replica_name
from meshd_mps.restore import Restore
from meshd_mps.serving.client import Client, ClientError, default_socket

T = TypeVar("T")

AGENT_PREFIX = "meshd-mps-agent-"
#: A failed load or upgrade of one replica is tried again after this (the daemon said why; the
#: controller shows it meanwhile).
RETRY_S = 5.0
#: Threads for requests to the daemon: calls in flight at once through this agent.
THREADS = 32


def agent_name(node_id: str) -> str:
    return AGENT_PREFIX + node_id


class NodeAgent:
    """One node's agent (an async Ray actor, pinned to its node).  ``socket``: the node daemon's
    (default: ``$MESHD_MPS_SOCKET`` of the node, as the CLI finds it)."""

    def __init__(self, socket: str | None = None, deadlines: Deadlines = DEFAULT):
        self.socket = socket or default_socket()
        self.d = deadlines
        self.node_id = ray.get_runtime_context().get_node_id()
        self.threads = concurrent.futures.ThreadPoolExecutor(THREADS, thread_name_prefix="meshd-agent")
        self.images: dict[str, dict[str, Any]] = {}
        self.data_keys: dict[str, str] = {}  # image hash -> the key its data has in this node's daemon
        self.want: dict[str, dict[str, Any]] | None = None  # None: no share yet: touch nothing
        self.keep: set[str] = set()
        self.errors: dict[str, tuple[str, str]] = {}  # replica -> (hash, why) of its last failed load/upgrade
        self.retry_at: dict[str, float] = {}
        self.busy: dict[str, str] = {}  # replica -> "loading" | "upgrading" | "unloading", while it is done
        self.wake = asyncio.Event()
        self.rounds = 0  # rounds of _apply that loaded, upgraded or unloaded something
        self.acted = asyncio.Event()  # set (and made anew) at the end of each such round
        self.task: asyncio.Task[None] | None = None
        self.daemon_pid: int | None = None
        self.daemon_socket: tuple[int, int] | None = None  # the socket file the pid was asked through
        self.calls = NodeCalls(self.socket, deadlines.fleet_agent)
        self.fleet: claim.FleetId | None = None  # this agent's fleet, as its controller names it
        self.foreign: dict[str, Any] | None = None  # another fleet's claim on the daemon, and why it binds
        self.port = callport.CallPortServer(self.calls)
        self.port_state: tuple[callport.CallPort | None, str | None] | None = None  # once opened: it, or why none

    # ---- the controller's side ----------------------------------------------------------------

    async def reconcile(self, orders: list[dict[str, Any]], keep: list[str] | None = None,
                        fleet: dict[str, Any] | None = None) -> dict[str, Any]:
        """Take ``orders`` (each: ``name``, ``hash``, ``restart``, and ``image`` where the
        controller has not seen this agent hold it) as this node's whole share, ``keep`` as the
        replicas Ray has placed nowhere yet (left alone where they run: a placement group made again
        after the head's restart has not landed yet), ``fleet`` as the fleet's id (``FleetId``'s
        JSON: the daemon's claim is taken by it); what the daemon runs of the fleet now."""
        self.fleet = claim.FleetId.from_json(fleet) or self.fleet
        self.keep = set(keep or ())
        for o in orders:
            if o.get("image") is not None:
                self.images[o["hash"]] = o["image"]
        self.want = {o["name"]: o for o in orders}
        used = {o["hash"] for o in orders}  # what no order names is forgotten: an upgrade's old image, a removed program's
        self.images = {h: im for h, im in self.images.items() if h in used}
        self.data_keys = {h: k for h, k in self.data_keys.items() if h in used}
        self.errors = {n: e for n, e in self.errors.items() if n in self.want}
        if self.task is None or self.task.done():
            self.task = asyncio.get_running_loop().create_task(self._run())
        self.wake.set()
        return await self.observe()

    async def observe(self) -> dict[str, Any]:
        """The daemon's ``fleet.*`` programs as its ``ps`` shows them, and this agent's own view."""
        port, port_error = self.port_state or await self._open_port()
        out: dict[str, Any] = {"node": self.node_id, "socket": self.socket, "pid": os.getpid(),
                               "have": sorted(self.images), "errors": dict(self.errors), "busy": dict(self.busy),
                               "programs": None, "error": None, "daemon_pid": self.daemon_pid, "claim": self.foreign,
                               "call_port": port, "call_port_error": port_error, "rounds": self.rounds}
        try:
            programs = await self._blocking(lambda c: c.programs())
            sock = _identity(self.socket)
            if self.daemon_pid is None or sock != self.daemon_socket:
                # A daemon that restarted between two looks (live restore: a second's gap) made its
                # socket again: its pid is asked for again, not kept from the old daemon.
                self.daemon_pid = (await self._blocking(lambda c: c.status())).get("pid")
                self.daemon_socket = sock
                out["daemon_pid"] = self.daemon_pid
        except ClientError as e:
            out["error"] = str(e)
            self.daemon_pid = None
            return out
        out["programs"] = [p for p in programs if parse_replica_name(str(p.get("name")))]
        return out

    async def call(self, name: str, data: bytes, timeout: float | None = None) -> bytes | NodeAnswer:  # noqa: ASYNC109
        """A request to replica ``name`` on this node's daemon: its response's bytes, or the
        ``NodeAnswer`` that says why none came (``NodeCalls.call``).  Bytes because Ray hands them
        back as they are (1 us to serialize, against 27 us for a NodeAnswer), and most calls answer."""
        out = await self.calls.call(name, data, timeout)
        return out.data if out.ok else out

    async def watch(self, since: int) -> dict[str, Any]:
        """The controller's call, kept outstanding: this agent's report (``observe``) once its count
        of rounds that changed its daemon's programs (loads, upgrades, unloads: the report's
        ``rounds``) is past ``since`` (at once if it is already), else after ``Deadlines.fleet_watch``.
        It tells the controller to look now, not at its next tick, with what it would ask for: after
        a change here, and, since the agent's end fails the call at once, when its node is lost or
        the actor killed."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(self.d.fleet_watch):
                while self.rounds <= since:
                    await self.acted.wait()
        return await self.observe()

    async def ping(self) -> str:
        return self.node_id

    async def _open_port(self) -> tuple[callport.CallPort | None, str | None]:
        """The call port (fleet/callport.py), opened once: it, or None and why not (``off``, a bad
        ``$MESHD_MPS_FLEET_CALL_PORT``, a port taken); the node's calls then go through Ray."""
        try:
            want = callport.configured()
            if want is None:
                self.port_state = None, f"${callport.ENV}=off: calls to this node go through Ray"
            else:
                self.port_state = await self.port.open(str(ray.util.get_node_ip_address()), want), None
        except (E.ConfigError, OSError) as e:
            self.port_state = None, f"no call port: {e}; calls to this node go through Ray"
        return self.port_state

    # ---- the loop -----------------------------------------------------------------------------

    async def _run(self) -> None:
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.wake.wait(), self.d.fleet_tick * 4)
            self.wake.clear()
            with contextlib.suppress(ClientError):  # the daemon is down or restarting: observe() says so
                await self._apply()

    async def _apply(self) -> None:
        want = self.want
        if want is None:
            return
        programs = {p["name"]: p for p in await self._blocking(lambda c: c.programs())
                    if parse_replica_name(str(p.get("name")))}
        if not await self._claimed(programs.keys(), want.keys() | self.keep):
            return  # another fleet's daemon: nothing of it is touched
        if await self._act(want, programs):
            self.rounds += 1  # the controller's watch answers: it looks now
            self.acted.set()
            self.acted = asyncio.Event()

    async def _act(self, want: dict[str, dict[str, Any]], programs: dict[str, dict[str, Any]]) -> bool:
        """This round's loads, upgrades and unloads; whether it tried one."""
        acted = False
        now = time.monotonic()
        for name, o in want.items():
            p = programs.get(name)
            if p is not None and p.get("hash") == o["hash"]:
                self.errors.pop(name, None)
                continue
            failed = self.errors.get(name)
            if failed is not None and failed[0] == o["hash"] and now < self.retry_at.get(name, 0.0):
                continue
            image = self.images.get(o["hash"])
            if image is None:
                continue  # the controller sends it with the next share (this agent's "have" lacks it)
            body = {"manifest": {**image["manifest"], "name": name}, "ptx": image["ptx"], "hash": o["hash"]}
            if image.get("data_bytes") and image.get("data") is None:
                self.errors[name] = (o["hash"], "its data is no longer in Ray's object store (the fleet's controller"
                                                " restarted since its deploy): deploy the program again with its data")
                self.retry_at[name] = now + RETRY_S
                continue
            if image.get("data") is not None:
                try:
                    body["data"] = await self._data(o["hash"], image["data"])
                except (ray.exceptions.RayError, ClientError) as e:
                    self.errors[name] = (o["hash"], f"its data not had from Ray's object store: {type(e).__name__}: {e}")
                    self.retry_at[name] = time.monotonic() + RETRY_S
                    continue
            if p is None and o.get("gpu") is not None:
                device = await self._device(o["gpu"])
                if device is not None:
                    body["device"] = device
            what = "loading" if p is None else "upgrading"
            acted = True
            self.busy[name] = what
            try:
                if p is None:
                    # restore adopt: a daemon that comes back does not load it again by itself (Ray
                    # may have placed it elsewhere meanwhile); it runs where this share says.
                    load = {**body, "restart": o["restart"], "restore": Restore.ADOPT.value}
                    await self._blocking(functools.partial(Client.load, body=load), self.d.fleet_node)
                else:
                    await self._blocking(functools.partial(Client.upgrade, name=name, body=body), self.d.fleet_node)
                self.errors.pop(name, None)
            except ClientError as e:
                if e.status == 0:
                    raise
                verb = "load" if p is None else "upgrade"
                if e.status == 404:  # its data gone from the daemon since it was sent: sent again next time
                    self.data_keys.pop(o["hash"], None)
                self.errors[name] = (o["hash"], f"{verb} refused by the node's daemon (HTTP {e.status}): {e}")
                self.retry_at[name] = time.monotonic() + RETRY_S
            finally:
                self.busy.pop(name, None)
        for name in programs.keys() - want.keys() - self.keep:
            if name in (self.want or {}) or name in self.keep:
                continue  # declared again while this round ran (removed, then deployed): the newest share wins
            self.busy[name] = "unloading"
            acted = True
            try:
                await self._blocking(functools.partial(Client.unload, name=name), self.d.fleet_node)
            except ClientError as e:
                if e.status == 0:
                    raise
            finally:
                self.busy.pop(name, None)
        return acted

    async def _claimed(self, running: Collection[str], mine: Collection[str]) -> bool:
        """Whether this agent's fleet holds the daemon's claim now (renewed, or taken: claim.look);
        if not, ``foreign`` says whose it is and why this agent touches nothing.  ``running``: the
        daemon's fleet replicas; ``mine``: those this fleet has there."""
        me = self.fleet
        if me is None:
            return False  # no fleet named yet: nothing is claimed, nothing touched
        path = claim.claim_path(self.socket)
        try:
            seen = await asyncio.get_running_loop().run_in_executor(
                self.threads, claim.look, path, me, set(running), set(mine), self.d.fleet_claim)
        except OSError as e:
            seen = None, f"the node's claim file {path} cannot be used ({e}): this fleet touches nothing there"
        held = None if seen is None else seen[0]
        self.foreign = None if seen is None else {"fleet": None if held is None else held.fleet.to_json(),
                                                  "why": seen[1]}
        return seen is None

    async def _data(self, image: str, ref: Any) -> str:
        """An image's data in this node's daemon (docs/program-abi.md, "Data"): taken from Ray's
        object store (a view of the object in this node's shared memory, read-only: no copy) and
        streamed to the daemon, which keeps it by its SHA-256; once per image while the agent lives
        (a daemon that dropped it since refuses the load, and the next round sends it again)."""
        key = self.data_keys.get(image)
        if key is None:
            arr = await ref
            view = memoryview(arr).cast("B")
            key = await self._blocking(functools.partial(Client.upload_bytes, data=view), self.d.fleet_node)
            self.data_keys[image] = key
        return key

    async def _device(self, model: str) -> int | None:
        """The GPU of ``model`` with the fewest programs on this node (a ``gpu`` constraint: Ray
        counted a slot of that model here; the daemon would otherwise take its least loaded GPU)."""
        status = await self._blocking(lambda c: c.status())
        gpus = [d for d in status.get("devices") or [] if gpu_model(str(d.get("name"))) == model]
        best = min(gpus, key=lambda d: (d.get("programs") or 0, d.get("device") or 0), default=None)
        return None if best is None else int(best["device"])

    async def _blocking(self, fn: Callable[[Client], T], within: float | None = None) -> T:
        client = Client(self.socket, timeout=within or self.d.fleet_agent)
        return await asyncio.get_running_loop().run_in_executor(self.threads, fn, client)


def _identity(path: str) -> tuple[int, int] | None:
    """The socket file's inode and change time: another once its daemon made it again."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_ino, st.st_ctime_ns
