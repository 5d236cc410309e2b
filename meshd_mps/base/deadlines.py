"""Every wait of meshd-mps, in seconds, in one table.

A wait without a deadline is a hang waiting to happen (STYLE.md: uvicorn's unbounded join); a
deadline defined where it is used is one nobody finds.  So every component takes its deadlines
from a :class:`Deadlines` its owner hands it (``Backend.open(deadlines=...)``; tests shorten
them), and the defaults are the seed's where the seed has one.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

#: Each request op whose reply is awaited (by its name: the op table is the protocol's, a layer up),
#: and the field of :class:`Deadlines` that bounds the wait.
_REPLY = {"LAUNCH": "launch", "READY": "ready", "LOAD": "load", "LIMIT": "load", "DATA": "data", "WRITE": "write",
          "PAYLOADS": "load"}


@dataclass(frozen=True)
class Deadlines:
    # ---- a worker's replies (the seed's) ----
    load: float = 30.0  # LOAD -> LOADED; a worker's first load also starts the MPS server (context creation)
    ready: float = 30.0  # READY -> READY: imported, context created
    launch: float = 2.0  # LAUNCH -> LAUNCHED
    start: float = 2.0  # LAUNCHED -> the program's STATE = RUNNING (the start check)
    data: float = 300.0  # DATA -> DATA: a program's data allocated and copied in from its file (up to the GPU's memory)
    write: float = 30.0  # WRITE -> WRITE: a write of up to a frame (64 MiB) copied into a program's data
    # ---- retiring workers (the seed's) ----
    retire_quit: float = 2.0  # QUIT -> exit
    retire_kill: float = 2.0  # SIGKILL -> reaped
    cleanup_reap: float = 0.5  # one shared deadline for every worker at exit
    cleanup_grace: float = 5.0  # after it, how long close() still waits for the late ones
    # ---- workers on sockets (live restore) ----
    connect: float = 10.0  # a worker started with --listen -> its socket takes our connection (retried meanwhile)
    hello: float = 30.0  # connected -> its HELLO (a worker opens its GPU first; one busy with another daemon waits)
    orphan: float = 30.0  # a --listen worker whose daemon's connection closed waits this long for the next one
    orphan_halt: float = 5.0  # a worker's own HALT (stdin EOF, the orphan timeout) -> its kernels' DONEs; it exits anyway
    # ---- programs ----
    halt: float = 5.0  # HALT -> the program's DONE (an upgrade, an unload, a blink)
    close_halt: float = 1.0  # the same at shutdown, every program at once
    call: float = 5.0  # a ring request -> its response (the API's default; the request may ask longer)
    call_max: float = 300.0  # the longest a request may ask for
    first_poll: float = 1.0  # a launch seen RUNNING -> its slot's SERVES (its first poll of the ring); else NotServing
    stall: float = 5.0  # a running program's heartbeat still -> "stalled" (serve --stall-after)
    fault_window: float = 2.0  # failures this close together are one fault; the server log is watched this long
    recover: float = 30.0  # a fault -> the server takes new clients again
    pool_pace: float = 0.25  # at least this between two replacements of dead pooled workers: each new
    #                          MPS client stalls the running ones once (~0.44 ms on the H200)
    restart_backoff: float = 0.1  # a failed program's first relaunch waits this, doubled for each failure
    restart_backoff_max: float = 30.0  # the longest a relaunch waits
    crash_loop_interval: float = 60.0  # restart.CRASH_LOOP_BURST failures within this: a crash loop
    # ---- the MPS control daemon ----
    control_command: float = 10.0  # one nvidia-cuda-mps-control command
    control_start: float = 10.0  # -d -> it answers
    control_quit: float = 5.0  # quit -> it has stopped its server
    control_reap: float = 5.0  # -> the daemon's process reaped (then SIGKILL, and as long again)
    control_kill: float = 2.0  # a control command that overran its deadline, killed -> reaped
    control_adopt: float = 2.0  # -d -> the daemonized process re-parented to us (then found by name at quit)
    # ---- NVML ----
    nvml: float = 5.0  # one look at every GPU's processes (a lost GPU can hang an NVML call)
    # ---- the control API ----
    http_head: float = 30.0  # to send the request line and headers
    http_body: float = 120.0  # to send the body
    http_grace: float = 10.0  # requests in flight at shutdown
    http_linger: float = 2.0  # an answered request's unread body still taken, so that its sender reads the answer
    # ---- serve's own ----
    reap: float = 3.0  # the forced exit (a second signal): every child killed and reaped
    notify: float = 1.0  # one datagram to systemd's notify socket (systemd drains it at once: a stuck one)
    socket_probe: float = 2.0  # whether a daemon answers on a socket found there at start (a stale one refuses)
    signal_echo: float = 0.5  # the same signal again this soon is the same request (make forwards the SIGTERM that
    #                           `kill -TERM %1` sent its whole job): only a later one forces the exit
    # ---- the fleet (meshd_mps/fleet/) ----
    fleet_tick: float = 0.5  # the controller's and each agent's reconcile loop: one look this often
    fleet_busy_tick: float = 0.1  # ... while a replica is on its way (placed, starting, moving, upgrading)
    fleet_agent: float = 10.0  # one answer of a node agent to the controller (else: its node not heard)
    fleet_watch: float = 30.0  # a node agent's watch (fleet/agent.py): it answers after a change it made, else this
    fleet_report: float = 2.0  # ... and with its replicas' heartbeats and call figures alone at most this often
    fleet_node: float = 60.0  # one request of an agent to its node daemon (a load compiles and starts)
    fleet_upgrade: float = 300.0  # a rolling upgrade, every replica (fleet.upgrade's wait)
    fleet_rejoin: float = 60.0  # after the head's restart, a node that ran replicas has this long to rejoin
    fleet_connect: float = 1.0  # a TCP connect to a node agent's call port (unanswered: the call goes through Ray)
    fleet_claim: float = 60.0  # a node daemon's fleet keeps it this long after its agent last looked (fleet/claim.py)
    fleet_lease: float = 30.0  # a unique replica's lease on its node: it stops there this long after the controller
    #                            last granted it (a head or node away longer halts it), and starts elsewhere only then
    fleet_skew: float = 1.0  # the hosts' clocks (NTP) agree within this: a lease is taken as running out this much later

    def reply(self, op: enum.Enum) -> float:
        """The deadline of the reply to request ``op`` (a ``frames.Op``; ``WorkerProc.ask``; no dict
        built per ask)."""
        field = _REPLY.get(op.name)
        if field is None:
            raise KeyError(op)
        return float(getattr(self, field))


#: The defaults, for components that are not handed a table of their own.
DEFAULT = Deadlines()
