"""What ``meshd-mps fleet status`` prints: a row per replica (PROGRAM REPLICA NODE GPU SLOT STATE
BEAT-AGE REASON), and with ``--watch`` a row again each time a replica changes, as ``kubectl get -w``
does; with ``--nodes`` a row per node; ``fleet events``' rows; ``--json``'s plain data.  Pure: it
reads the API's views and asks nothing."""

from __future__ import annotations

import dataclasses
import enum
import time
from collections.abc import Iterable
from typing import Any

from meshd_mps.serving.tables import duration, table

HEAD = ["PROGRAM", "REPLICA", "NODE", "GPU", "SLOT", "STATE", "BEAT-AGE", "REASON"]
NODE_HEAD = ["NODE", "ID", "ALIVE", "AGENT", "SLOTS", "REPLICAS", "FREE", "DAEMON-PID", "CALL-PORT", "REASON"]
EVENT_HEAD = ["TIME", "KIND", "MESSAGE"]

#: What ``--watch`` prints for a replica no longer in the status (removed, or its program scaled down).
GONE = "gone"


def _cell(v: object) -> str:
    return "-" if v is None else str(v)


def node(r: Any) -> str:
    """NODE: the node's name where it advertises one, else its Ray node id (shortened as Ray's own
    ``ray list nodes`` is read: the first 12 hex digits tell a cluster's nodes apart)."""
    return r.node_name or ("-" if r.node is None else str(r.node)[:12])


def row(r: Any) -> list[str]:
    """A replica's row; ``r`` is a ReplicaView (program, index, node, gpu, slot, state,
    heartbeat_age, reason)."""
    age = r.heartbeat_age
    return [r.program, str(r.index), node(r), _cell(r.gpu), _cell(r.slot), _cell(r.state),
            "-" if age is None else duration(float(age)), r.reason or ""]


def replicas(status: Any) -> list[Any]:
    """Every replica of a FleetStatus, program by program."""
    return [r for p in status.programs for r in p.replicas]


def status_table(views: Iterable[Any]) -> str:
    rows = [row(r) for r in sorted(views, key=lambda r: (r.program, r.index))]
    out = table([HEAD, *rows])
    return out if rows else out + "(no replicas)\n"


def node_table(nodes: Iterable[Any]) -> str:
    """A row per node (``NodeView``): whether it and its agent are up, its slots, the replicas Ray
    placed there, the slots still free to this fleet, its agent's call port (-: its calls go through
    Ray), and why it is not usable (another fleet's daemon, its agent not answering)."""
    rows = [[n.name, str(n.node)[:12], "yes" if n.alive else "no", n.agent, str(n.slots), str(n.replicas), str(n.free),
             _cell(n.daemon_pid), _cell(n.call_port), n.reason or ""] for n in sorted(nodes, key=lambda n: (n.name, n.node))]
    out = table([NODE_HEAD, *rows])
    return out if rows else out + "(no nodes)\n"


def events_table(events: Iterable[Any]) -> str:
    """A row per event, oldest first, with its local time."""
    rows = [[time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(e.at)), e.kind, e.message]
            for e in sorted(events, key=lambda e: e.at)]
    out = table([EVENT_HEAD, *rows])
    return out if rows else out + "(no events)\n"


def _key(r: Any) -> tuple[str, int]:
    return (r.program, r.index)


def _seen(cells: list[str]) -> list[str]:
    """The columns a change is judged by: every one but BEAT-AGE, which moves every second while
    all is well (a stalled heartbeat shows as the STATE the node gives it)."""
    return cells[:6] + cells[7:]


def event_line(e: Any) -> str:
    """An event as ``--watch`` prints it between the rows."""
    when = time.strftime("%H:%M:%S", time.localtime(e.at))
    return f"# {when} {e.kind}: {e.message}\n"


class Watch:
    """``status --watch``: the rows last printed, and those to print for a newer status (each
    replica that changed or appeared, and each that is gone, once), after the events that are new
    (a replica moved, a node lost)."""

    def __init__(self, status: Any):
        self.last = {_key(r): row(r) for r in replicas(status)}
        self.seen = max((e.at for e in status.events), default=0.0)

    def changes(self, status: Any) -> str:
        new = [e for e in status.events if e.at > self.seen]
        self.seen = max((e.at for e in new), default=self.seen)
        events = "".join(event_line(e) for e in sorted(new, key=lambda e: e.at))
        now = {_key(r): row(r) for r in replicas(status)}
        out = [cells for k, cells in sorted(now.items()) if k not in self.last or _seen(self.last[k]) != _seen(cells)]
        for k in sorted(self.last.keys() - now.keys()):
            old = self.last[k]
            out.append([*old[:5], GONE, "-", ""])
        self.last = now
        widths = [len(h) for h in HEAD]
        return events + "".join("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() + "\n" for r in out)


def as_json(obj: Any) -> Any:
    """The API's views (their ``to_json``, else dataclasses, enums, bytes) as plain JSON data."""
    if callable(getattr(obj, "to_json", None)):
        return as_json(obj.to_json())
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: as_json(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, enum.Enum):
        return as_json(obj.value)
    if isinstance(obj, dict):
        return {str(k): as_json(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple, set, frozenset)):
        return [as_json(v) for v in obj]
    if isinstance(obj, bytes):
        return obj.hex()
    return obj
