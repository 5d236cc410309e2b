"""``Fleet``: the fleet's async Python API, a handle on the controller actor, and the routing of
calls by name.

A call goes to a running replica, the caller's own node first: straight to that node's daemon
socket (no actor in the way) when the replica runs on the caller's node, else to the replica's
node agent's call port (fleet/callport.py: TCP, no Ray hop), and through the agent as a Ray actor
call where the port is off or cannot be reached (then not tried again for ``PORT_RETRY_S``). The
routes (which replicas run, where) come from the controller and are kept for one tick
(``Deadlines.fleet_tick``); an upgrade drains a replica for longer than that before it changes its
image, so that no call is sent to one that is being replaced. A call that never reached a program
(no daemon there, the program not there) is sent to the next replica; a call whose replica's node
or agent died on the way is sent again only if ``idempotent``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import os
import random
import time
from typing import Any

import ray
from ray.exceptions import ActorUnschedulableError, RayActorError, RayTaskError

from meshd_mps.base.deadlines import DEFAULT, Deadlines
from meshd_mps.base.errors import (
    CallPortToken,
    CallRefused,
    FleetTimeout,
    FleetUnavailable,
    MeshError,
    NoReplica,
    ReplicaLost,
)
from meshd_mps.fleet.controller import CONTROLLER, FleetController
from meshd_mps.fleet.desired import Image, Spec
from meshd_mps.fleet.nodecalls import NodeAnswer, NodeCalls
from meshd_mps.fleet.spec import (
    CallPort,
    FleetProgram,
    FleetReply,
    FleetStatus,
    ProgramSource,
    ProgramSpec,
    ReplicaView,
    Routes,
    Via,
)
from meshd_mps.serving.status import STATUS

HINT = "start Ray (ray start --head), or name its address (--address, $RAY_ADDRESS)"
#: A call port that could not be reached (a firewall, its host gone) is not tried again for this
#: long: the node's calls go through Ray meanwhile.
PORT_RETRY_S = 30.0


class Fleet:
    """A handle on the fleet of one Ray cluster (``await Fleet.connect()``): declare, see, upgrade,
    remove and call programs by name.  Every method asks the controller actor, except a call's
    routes, kept for one tick, and the call itself (this node's daemon, or the replica's agent)."""

    def __init__(self, controller: Any, namespace: str, owns_ray: bool, deadlines: Deadlines):
        self.controller = controller
        self.ns = namespace
        self.d = deadlines
        self.owns_ray = owns_ray
        self.node = ray.get_runtime_context().get_node_id()
        self.cache: dict[str, tuple[float, Routes]] = {}
        # Each caller starts the turn at its own replica: a process that makes one call (the CLI's)
        # would otherwise always reach the first.
        self.turn = itertools.count(random.randrange(1 << 30))
        self.direct: dict[str, NodeCalls] = {}  # this node's daemons, called without an actor between
        self.ports: dict[CallPort, NodeCalls] = {}  # other nodes' call ports
        self.unreachable: dict[CallPort, float] = {}  # a call port -> when it may be tried again (monotonic)

    @classmethod
    async def connect(cls, address: str | None = None, *, namespace: str = "meshd-mps", state_dir: str | None = None,
                      deadlines: Deadlines = DEFAULT) -> Fleet:
        """The fleet of the Ray cluster at ``address`` (default: ``$RAY_ADDRESS``, else the local
        cluster ``ray start`` began); its controller is started if none runs (on the head node;
        ``state_dir``: its checkpoint's directory there, default ``$MESHD_MPS_FLEET_STATE_DIR`` of the
        head, see fleet/checkpoint.py).  FleetUnavailable if no cluster answers."""
        owns = not ray.is_initialized()
        if owns:
            addr = address or os.environ.get("RAY_ADDRESS") or "auto"
            try:
                # On this thread: ray.init sets its signal handlers on the main thread only.
                ray.init(address=addr, namespace=namespace, logging_level=logging.WARNING, log_to_driver=False)
            except (ConnectionError, RuntimeError, ValueError) as e:
                raise FleetUnavailable(f"no Ray cluster at {addr}: {e}", hint=HINT) from e
        actor: Any = ray.remote(FleetController)
        ctl = await asyncio.to_thread(
            lambda: actor.options(
                name=CONTROLLER, namespace=namespace, lifetime="detached", get_if_exists=True, max_restarts=-1,
                num_cpus=0, resources={"node:__internal_head__": 0.001}).remote(namespace, state_dir, deadlines))
        f = cls(ctl, namespace, owns, deadlines)
        await f._ask(ctl.ready.remote())
        return f

    # ---- declare, see ----------------------------------------------------------------------------

    async def deploy(self, spec: ProgramSpec) -> FleetProgram:
        """Declare ``spec``: Ray places its replicas, their nodes load them (``wait`` for them)."""
        spec.check()
        image = Image(manifest=spec.source.manifest, ptx=spec.source.ptx, hash=spec.source.hash)
        data_node = None
        if spec.source.data is not None:
            ref, size = await asyncio.to_thread(self._put_data, spec.source.data)
            image = dataclasses.replace(image, data=ref, data_bytes=size)
            data_node = ray.get_runtime_context().get_node_id()  # where its bytes are (fleet/data.py)
        declared = Spec(name=spec.name, replicas=spec.replicas, restart=spec.restart, strategy=spec.strategy,
                        image=image, gpu=spec.gpu, node=spec.node, unique=spec.unique)
        return await self._ask(self.controller.deploy.remote(declared, data_node))

    def _put_data(self, path: str) -> tuple[Any, int]:
        """A data file into Ray's object store, read through a memory map (this process holds no
        copy); the controller makes the object its own and keeps its ref in the program's declared
        spec (fleet/data.py), and each node's agent takes it from there for its daemon."""
        import numpy as np

        from meshd_mps.base.errors import BadSpec

        try:
            size = os.path.getsize(path)
            arr = np.memmap(path, dtype=np.uint8, mode="r") if size else np.zeros(0, np.uint8)
        except (OSError, ValueError) as e:
            raise BadSpec(f"data {path}: {getattr(e, 'strerror', None) or e}", field="data") from e
        return ray.put(arr), size  # the controller makes it its own (fleet/data.py)

    async def upgrade(self, name: str, source: ProgramSource, *, hash: str | None = None) -> FleetProgram:
        """A rolling upgrade to ``source``: one replica at a time, each passing its node's start check
        before the next; the program once every replica placed runs it, UpgradeFailed if one
        refused it (every replica is rolled back to the image before)."""
        from meshd_mps.base.errors import BadSpec, UpgradeFailed

        got = source.hash
        if hash is not None and hash.lower() != got:
            raise BadSpec(f"hash {hash}: the image's hash is {got}", field="hash")
        p: FleetProgram = await self._ask(self.controller.upgrade.remote(
            name, Image(manifest=source.manifest, ptx=source.ptx, hash=got)))
        deadline = time.monotonic() + self.d.fleet_upgrade
        while True:
            p = await self._ask(self.controller.program.remote(name))
            if p.upgrade_error is not None and p.hash != got:
                bad = next((r for r in p.replicas if r.reason == p.upgrade_error), None)
                raise UpgradeFailed(f"{name}: upgrade to {got} stopped: {p.upgrade_error}", program=name,
                                    replica=str(bad.index) if bad else "", why=p.upgrade_error)
            if not p.upgrading and p.hash == got and \
                    all(r.state == "pending" or (r.state == "running" and r.hash == got) for r in p.replicas):
                return p  # every replica placed runs it; one with no node takes it when it gets one
            if time.monotonic() > deadline:
                raise FleetTimeout(f"{name}: upgrade to {got}: {p.running} of {p.wanted} replicas run it after"
                                   f" {self.d.fleet_upgrade:g}s", program=name, running=p.running, wanted=p.wanted)
            await asyncio.sleep(self.d.fleet_tick / 2)  # polling the controller's view

    async def remove(self, name: str) -> None:
        await self._ask(self.controller.remove.remote(name))
        self.cache.pop(name, None)

    async def status(self, name: str | None = None) -> FleetStatus:
        return await self._ask(self.controller.status.remote(name))

    async def program(self, name: str) -> FleetProgram:
        """One program's view (its replicas), as ``status(name)`` shows it, without the events and
        nodes: what a caller that polls one program asks for."""
        return await self._ask(self.controller.program.remote(name))

    async def wait(self, name: str, *, running: int, timeout: float) -> FleetProgram:  # noqa: ASYNC109
        """The program once ``running`` of its replicas run its declared image; FleetTimeout after
        ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while True:
            p = await self.program(name)
            if p.running >= running:
                return p
            if time.monotonic() > deadline:
                why = "; ".join(sorted({f"{r.state}: {r.reason}" for r in p.replicas if r.reason})) or "none failed"
                raise FleetTimeout(f"{name}: {p.running} of {running} replicas running after {timeout:g}s ({why})",
                                   program=name, running=p.running, wanted=running)
            await asyncio.sleep(min(self.d.fleet_tick / 2, 0.1))  # polling the controller's view

    async def close(self) -> None:
        for d in [*self.direct.values(), *self.ports.values()]:
            await d.close()
        if self.owns_ray and ray.is_initialized():
            await asyncio.to_thread(ray.shutdown)

    # ---- calls -------------------------------------------------------------------------------------

    async def call(self, name: str, data: bytes, *, timeout: float | None = None,  # noqa: ASYNC109
                   idempotent: bool = False) -> FleetReply:
        """``data`` to a running replica of ``name``, the caller's own node first; the reply says
        which replica answered."""
        tried: list[str] = []
        for fresh in (False, True):
            routes = await self._routes(name, fresh)
            for r in self._order(routes.replicas):
                if f"{r.index}@{r.node}" in tried:
                    continue
                tried.append(f"{r.index}@{r.node}")
                try:
                    got, via = await self._call_one(r, routes, data, timeout)
                except _NotDelivered:
                    continue
                except _Lost as e:
                    self.cache.pop(name, None)
                    if idempotent:
                        continue
                    raise ReplicaLost(f"{name}: replica {r.index} on node {r.node_name} was lost during the call"
                                      f" ({e}); not sent again (not idempotent)", program=name, replica=str(r.index),
                                      node=r.node or "") from e
                return FleetReply(got, r, via)
            self.cache.pop(name, None)
        raise NoReplica(f"{name}: no running replica answered (tried {', '.join(tried) or 'none: none runs'})",
                        program=name, tried=tried)

    async def _routes(self, name: str, fresh: bool) -> Routes:
        hit = self.cache.get(name)
        if hit is not None and not fresh and time.monotonic() - hit[0] < self.d.fleet_tick:
            return hit[1]
        routes: Routes = await self._ask(self.controller.routes.remote(name))
        self.cache[name] = (time.monotonic(), routes)
        await self._forget_ports()
        return routes

    async def _forget_ports(self) -> None:
        """The connections to call ports no route names any more (a restarted agent listens on
        another port), closed: a long-lived caller keeps none of the old ones."""
        named = {p for _, r in self.cache.values() for p in r.ports.values()}
        for port in [p for p in self.ports if p not in named]:
            await self.ports.pop(port).close()
        self.unreachable = {p: t for p, t in self.unreachable.items() if p in named}

    def _order(self, replicas: list[ReplicaView]) -> list[ReplicaView]:
        mine = [r for r in replicas if r.node == self.node]
        others = [r for r in replicas if r.node != self.node]
        if others:
            k = next(self.turn) % len(others)
            others = others[k:] + others[:k]
        return mine + others

    async def _call_one(self, r: ReplicaView, routes: Routes, data: bytes,
                        timeout: float | None) -> tuple[bytes, Via]:  # noqa: ASYNC109
        node = r.node or ""
        socket, port = routes.sockets.get(node), routes.ports.get(node)
        out: NodeAnswer | None = None
        via: Via
        if r.node == self.node and socket:
            direct = self.direct.get(socket)
            if direct is None:
                direct = self.direct[socket] = NodeCalls(socket, self.d.fleet_agent)
            out, via = await direct.call(r.name, data, timeout), "socket"
        elif port is not None and time.monotonic() >= self.unreachable.get(port, 0.0):
            calls = self.ports.get(port)
            if calls is None:
                calls = self.ports[port] = NodeCalls("", self.d.fleet_agent, port=port, connect=self.d.fleet_connect)
            out, via = await calls.call(r.name, data, timeout), "call-port"
            if out.unreachable:  # nothing sent: the same replica through Ray, and the port left alone a while
                self.unreachable[port] = time.monotonic() + PORT_RETRY_S
                out = None
            elif out.status == STATUS[CallPortToken]:  # the agent restarted with another token: the routes are old
                raise _NotDelivered(out.error)
        if out is None:
            out, via = await self._through_ray(routes.agents.get(node), r, data, timeout), "ray"
        if not out.ok:
            if out.lost:
                raise _Lost(out.error)
            raise _refusal(r, out.status, out.error)
        return out.data, via

    async def _through_ray(self, agent: Any, r: ReplicaView, data: bytes, timeout: float | None) -> NodeAnswer:  # noqa: ASYNC109
        """The call as an actor call of the replica's node agent."""
        if agent is None:
            raise _NotDelivered(f"node {r.node} has no agent")
        within = (self.d.call if timeout is None else timeout) + 2 * self.d.fleet_agent
        try:
            # asyncio.timeout, not wait_for: no task per call (the call's hot path).
            async with asyncio.timeout(within):
                got = await agent.call.remote(r.name, data, timeout)
            return NodeAnswer(True, got) if isinstance(got, bytes) else got  # NodeAgent.call: bytes, or why not
        except (RayActorError, ActorUnschedulableError) as e:  # the latter: its node known dead to Ray
            raise _Lost(f"{type(e).__name__}") from e
        except TimeoutError as e:  # the agent's node cut off: the call may have reached the program
            raise _Lost(f"its agent did not answer in {within:g}s") from e

    async def _ask(self, ref: Any) -> Any:
        """An actor call's answer; the controller's own errors as raised there, typed."""
        try:
            return await ref
        except RayTaskError as e:
            if isinstance(e.cause, MeshError):
                raise e.cause from None
            raise
        except RayActorError as e:
            raise FleetUnavailable(f"the fleet's controller is not reachable: {type(e).__name__}",
                                   hint="it is restarted by Ray; try again") from e


class _NotDelivered(Exception):
    """The call never reached a program: another replica may take it."""


class _Lost(Exception):
    """The replica's agent or node died with the call on its way: it may have reached the program."""


def _refusal(r: ReplicaView, status: int, error: str) -> Exception:
    if status in (0, 404):  # no daemon on the socket, or the program is not there: not delivered
        return _NotDelivered(error)
    return CallRefused(f"{r.program}: replica {r.index} on node {r.node_name}: {error}", program=r.program,
                       replica=str(r.index), status=status)
