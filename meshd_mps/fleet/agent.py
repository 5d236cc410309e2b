"""The node agent: a Ray actor per node that makes its node's daemon run that node's share of the
fleet, and nothing more of the fleet's.

The daemon keeps the programs (``meshd-mps serve --live-restore``, started by systemd, a DaemonSet
or the tests, never by Ray, so that no Ray process is its parent): the agent holds no program and
no process.  It is level-triggered: each share the controller sends (``apply``: a ``Share``,
messages.py) replaces the last, and its own loop, every ``fleet_tick`` and at once when a share
comes, reads the daemon's ``ps`` and closes the difference (load what is missing, upgrade what runs
another image, unload a ``fleet.*`` program the share no longer names nor keeps: a replica Ray moved
away while this node was gone).  A restarted agent starts with no share and touches nothing until
the controller sends one: what runs is adopted by being found running.  Every replica is loaded
with restore ``adopt`` (restore.py): a daemon that restarts adopts it while it runs, and never loads
it again by itself (a node lost and back would run a replica Ray re-placed meanwhile).  A unique
replica is loaded with its share's lease (``lease_until``) and its lease renewed with each share
that grants a later one: when the grants stop (this agent, its Ray or the controller gone), the
daemon stops the replica by itself (serving/leases.py).  It loads and unloads only while its fleet
holds the daemon's claim (claim.py), renewed at each look: another fleet's daemon it leaves as it
is, and says why (the report's ``claim``).

What it saw and did is its ``AgentReport`` (messages.py), whose ``version`` moves on when anything
but the heartbeats changed: the controller's watch call (``watch``) answers then, so that a node
where nothing happens sends nothing.

It talks to the daemon through ``serving/client.Client`` (blocking, stdlib HTTP over the Unix
socket) in threads of its own, so that calls in flight and the loop share no thread.  Calls from
other nodes come to it as Ray actor calls (``call``) or, without the Ray hop, on its call port
(callport.py), opened at its first look and reported with it.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import functools
import math
import os
import time
from collections.abc import Callable, Collection
from typing import Any, TypeVar

import ray

from meshd_mps.base import errors as E
from meshd_mps.base.deadlines import DEFAULT, Deadlines
from meshd_mps.base.restore import Restore
from meshd_mps.fleet import callport, claim
from meshd_mps.fleet.messages import AgentReport, DaemonProgram, ForeignClaim, Order, Share, changed_since
from meshd_mps.fleet.nodecalls import NodeAnswer, NodeCalls
from meshd_mps.fleet.spec import parse_replica_name, resource_key
from meshd_mps.serving.client import Client, ClientError, default_socket

T = TypeVar("T")

AGENT_PREFIX = "meshd-mps-agent-"
#: A failed load or upgrade of one replica is tried again after this (the daemon said why; the
#: controller shows it meanwhile).
RETRY_S = 5.0
#: Threads for requests to the daemon: calls in flight at once through this agent.
THREADS = 32
#: The reports whose changed replicas are kept: a watch from further back is answered whole.
HISTORY = 64


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
        self.share: Share | None = None  # None: no share yet: touch nothing
        self.images: dict[str, dict[str, Any]] = {}
        self.data_keys: dict[str, str] = {}  # image hash -> the key its data has in this node's daemon
        self.errors: dict[str, tuple[str, str]] = {}  # replica -> (hash, why) of its last failed load/upgrade
        self.retry_at: dict[str, float] = {}
        self.busy: dict[str, str] = {}  # replica -> "loading" | "upgrading" | "unloading", while it is done
        self.programs: dict[str, DaemonProgram] | None = None  # the daemon's fleet replicas at the last look
        self.error: str | None = None  # why the daemon did not answer the last look
        self.daemon_pid: int | None = None
        self.daemon_socket: tuple[int, int] | None = None  # the socket file the pid was asked through
        self.stop_within: float | None = None
        self.renewed = -math.inf  # the lease the daemon was last given (wall-clock seconds)
        self.version = 0
        self.said: tuple[Any, ...] | None = None  # what the report at ``version`` said of no one replica
        self.rows: dict[str, tuple[Any, ...]] = {}  # ... and of each replica (its heartbeat aside)
        self.held: tuple[str, int] | None = None  # ... and the share it held
        self.figures: dict[str, tuple[Any, ...]] = {}  # ... and each replica's heartbeat and calls
        self.published = -math.inf  # when ``version`` last moved on (monotonic)
        self.history: collections.deque[tuple[int, frozenset[str] | None]] = collections.deque(maxlen=HISTORY)
        self.changed = asyncio.Event()  # set (and made anew) when ``version`` moves on
        self.wake = asyncio.Event()
        self.task: asyncio.Task[None] | None = None
        self.calls = NodeCalls(self.socket, deadlines.fleet_agent)
        self.fleet: claim.FleetId | None = None  # this agent's fleet, as its controller names it
        self.foreign: ForeignClaim | None = None  # another fleet's claim on the daemon, and why it binds
        self.port = callport.CallPortServer(self.calls)
        self.port_state: tuple[callport.CallPort | None, str | None] | None = None  # once opened: it, or why none

    # ---- the controller's side ----------------------------------------------------------------

    async def apply(self, share: Share, since: int = -1) -> AgentReport:
        """Take ``share`` as this node's whole share (unless the one held is later: shares may
        cross on their way); this agent's report, with the replicas changed since report ``since``."""
        self._start()
        cur = self.share
        if cur is None or share.version[0] != cur.version[0] or share.version[1] > cur.version[1] or \
                (share.version == cur.version and (share.lease_until or 0) > (cur.lease_until or 0)):
            self.images.update(share.images)
            used = {o.hash for o in share.orders}  # what no order names is forgotten: an old image, a removed program's
            self.images = {h: im for h, im in self.images.items() if h in used}
            self.data_keys = {h: k for h, k in self.data_keys.items() if h in used}
            names = {o.name for o in share.orders}
            self.errors = {n: e for n, e in self.errors.items() if n in names}
            self.fleet = share.fleet or self.fleet
            self.share = share
            self.wake.set()
        self._publish()
        return await self._report(since)

    async def watch(self, since: int) -> AgentReport:
        """The controller's call, kept outstanding: this agent's report once its ``version`` is
        past ``since`` (at once if it is already: ``since`` -1 asks for it now), else after
        ``Deadlines.fleet_watch``.  It tells the controller to look now, not at its next tick, after
        a change here, and, since the agent's end fails the call at once, when its node is lost or
        the actor killed."""
        self._start()
        if self.programs is None and self.error is None:
            with contextlib.suppress(ClientError):  # the first ask: the daemon looked at first
                await self._look()
            self._publish()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(self.d.fleet_watch):
                while self.version <= since:
                    await self.changed.wait()
        return await self._report(since)

    async def call(self, name: str, data: bytes, timeout: float | None = None) -> bytes | NodeAnswer:  # noqa: ASYNC109
        """A request to replica ``name`` on this node's daemon: its response's bytes, or the
        ``NodeAnswer`` that says why none came (``NodeCalls.call``).  Bytes because Ray hands them
        back as they are (1 us to serialize, against 27 us for a NodeAnswer), and most calls answer."""
        out = await self.calls.call(name, data, timeout)
        return out.data if out.ok else out

    async def ping(self) -> str:
        return self.node_id

    async def _report(self, since: int = -1) -> AgentReport:
        port, port_error = self.port_state or await self._open_port()
        return AgentReport(node=self.node_id, version=self.version, socket=self.socket, pid=os.getpid(),
                           programs=None if self.programs is None else dict(self.programs), error=self.error,
                           daemon_pid=self.daemon_pid,
                           share=self.share.version if self.share is not None else None, have=frozenset(self.images),
                           errors=dict(self.errors), busy=dict(self.busy), claim=self.foreign, call_port=port,
                           call_port_error=port_error, stop_within=self.stop_within,
                           changed=changed_since(self.history, self.version, since))

    def _publish(self) -> None:
        """``version`` moved on if the report says anything new (the heartbeats' counts and ages
        aside), the replicas it changed kept (``history``), and the watches answered."""
        said = (self.programs is None, self.error, self.daemon_pid, frozenset(self.images), self.foreign,
                self.port_state, self.stop_within)
        share = self.share.version if self.share else None
        rows = {name: p.key() for name, p in (self.programs or {}).items()}
        for name, e in self.errors.items():
            rows[name] = (*rows.get(name, ()), "error", e)
        for name, what in self.busy.items():
            rows[name] = (*rows.get(name, ()), what)
        names = frozenset(n for n in rows.keys() | self.rows.keys() if rows.get(n) != self.rows.get(n))
        figures = {name: p.figures() for name, p in (self.programs or {}).items()}
        moved = frozenset(n for n, f in figures.items() if f != self.figures.get(n))
        now = time.monotonic()
        if said == self.said and not names and share == self.held and \
                not (moved and now - self.published >= self.d.fleet_report):
            return
        self.version += 1
        self.history.append((self.version, names | moved if said == self.said else None))
        self.said, self.rows, self.held, self.figures, self.published = said, rows, share, figures, now
        self.changed.set()
        self.changed = asyncio.Event()

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

    def _start(self) -> None:
        if self.task is None or self.task.done():
            self.task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.wake.wait(), self.d.fleet_tick)
            self.wake.clear()
            with contextlib.suppress(ClientError):  # the daemon is down or restarting: the report says so
                await self._look()
                if await self._apply():
                    await self._look()
                await self._renew()
            if self.port_state is None:
                await self._open_port()
            self._publish()

    async def _look(self) -> None:
        """The daemon's fleet replicas, its pid (asked again when its socket was made again: a
        daemon restarted with live restore) and how long past a lease its programs may run."""
        try:
            rows = await self._blocking(lambda c: c.programs())
            sock = _identity(self.socket)
            if self.daemon_pid is None or sock != self.daemon_socket:
                status = await self._blocking(lambda c: c.status())
                self.daemon_pid, self.daemon_socket = status.get("pid"), sock
                self.stop_within = (status.get("leases") or {}).get("stop_within")
        except ClientError as e:
            self.programs, self.error, self.daemon_pid = None, str(e), None
            raise
        self.programs = {str(p.get("name")): DaemonProgram.from_row(p) for p in rows
                         if parse_replica_name(str(p.get("name")))}
        self.error = None

    async def _apply(self) -> bool:
        """This round's loads, upgrades and unloads; whether it tried one.  A share that comes while
        the round loads is taken into it (its orders loaded in the same round, one after another,
        as a node's loads go), not left to the next."""
        share = self.share
        if share is None or self.programs is None:
            return False
        have = {name: p.hash for name, p in self.programs.items()}
        if not await self._claimed(have.keys(), {o.name for o in share.orders} | share.keep):
            return False  # another fleet's daemon: nothing of it is touched
        acted = False
        tried: set[str] = set()
        while (o := self._next(have, tried)) is not None:
            tried.add(o.name)
            acted = True
            if await self._load(o, upgrade=o.name in have):
                have[o.name] = o.hash
        for name in sorted(have.keys() - self._wanted()):
            if name in self._wanted():
                continue  # declared again while this round ran (removed, then deployed): the newest share wins
            acted = True
            self.busy[name] = "unloading"
            try:
                await self._blocking(functools.partial(Client.unload, name=name), self.d.fleet_node)
            except ClientError as e:
                if e.status == 0:
                    raise
            finally:
                self.busy.pop(name, None)
        return acted

    def _next(self, have: dict[str, str | None], tried: set[str]) -> Order | None:
        """The next order of the share held now that the daemon does not run yet, and this round
        has not tried."""
        s = self.share
        for o in s.orders if s is not None else ():
            if have.get(o.name) == o.hash:
                self.errors.pop(o.name, None)
            elif o.name not in tried and self._due(o):
                return o
        return None

    def _wanted(self) -> set[str]:
        """What the share held now orders or keeps (it may have changed since the round began)."""
        s = self.share
        return set() if s is None else {o.name for o in s.orders} | s.keep

    def _due(self, o: Order) -> bool:
        """Whether order ``o`` is to be tried now: not refused lately, its image here."""
        failed = self.errors.get(o.name)
        return not (failed is not None and failed[0] == o.hash and time.monotonic() < self.retry_at.get(o.name, 0.0)) \
            and o.hash in self.images  # else the controller sends it with the next share (this report's "have")

    async def _load(self, o: Order, upgrade: bool) -> bool:
        """Replica ``o`` loaded or upgraded to its image; whether it now runs it."""
        image = self.images[o.hash]
        body: dict[str, Any] = {"manifest": {**image["manifest"], "name": o.name}, "ptx": image["ptx"], "hash": o.hash}
        if image.get("data_bytes") and image.get("data") is None:
            return self._refused(o, "its data is no longer in Ray's object store (the fleet's controller restarted"
                                 " since its deploy): deploy the program again with its data")
        if image.get("data") is not None:
            try:
                body["data"] = await self._data(o.hash, image["data"])
            except (ray.exceptions.RayError, ClientError) as e:
                return self._refused(o, f"its data not had from Ray's object store: {type(e).__name__}: {e}")
        if not upgrade and o.gpu is not None:
            device = await self._device(o.gpu)
            if device is not None:
                body["device"] = device
        s = self.share
        until = s.lease_until if s is not None else None
        if not upgrade and o.unique and (until is None or s is None or o.name not in s.leased):
            return self._refused(o, "unique: no lease granted for it here (the controller's next share grants it)")
        self.busy[o.name] = "upgrading" if upgrade else "loading"
        try:
            if upgrade:
                await self._blocking(functools.partial(Client.upgrade, name=o.name, body=body), self.d.fleet_node)
            else:
                # restore adopt: a daemon that comes back does not load it again by itself (Ray may have
                # placed it elsewhere meanwhile); it runs where this share says.
                load = {**body, "restart": o.restart, "restore": Restore.ADOPT.value}
                if o.unique:
                    load["lease_until"] = until
                await self._blocking(functools.partial(Client.load, body=load), self.d.fleet_node)
            self.errors.pop(o.name, None)
            return True
        except ClientError as e:
            if e.status == 0:
                raise
            if e.status == 404:  # its data gone from the daemon since it was sent: sent again next time
                self.data_keys.pop(o.hash, None)
            verb = "upgrade" if upgrade else "load"
            return self._refused(o, f"{verb} refused by the node's daemon (HTTP {e.status}): {e}")
        finally:
            self.busy.pop(o.name, None)

    def _refused(self, o: Order, why: str) -> bool:
        """Order ``o`` not carried out, and why: said in the report, tried again after RETRY_S."""
        self.errors[o.name] = (o.hash, why)
        self.retry_at[o.name] = time.monotonic() + RETRY_S
        return False

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

    async def _renew(self) -> None:
        """The leases of the unique replicas the share grants this node, held until its
        ``lease_until`` (once for each later grant)."""
        s = self.share
        if s is None or s.lease_until is None or s.lease_until <= self.renewed or self.programs is None:
            return
        names = sorted(s.leased & self.programs.keys())
        if names:
            await self._blocking(functools.partial(Client.renew, names=names, until=s.lease_until))
        self.renewed = s.lease_until

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
        self.foreign = None if seen is None else ForeignClaim(None if held is None else held.fleet, seen[1])
        return seen is None

    async def _device(self, model: str) -> int | None:
        """The GPU of ``model`` with the fewest programs on this node (a ``gpu`` constraint: Ray
        counted a slot of that model here; the daemon would otherwise take its least loaded GPU)."""
        status = await self._blocking(lambda c: c.status())
        gpus = [d for d in status.get("devices") or [] if resource_key(str(d.get("name"))) == model]
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
