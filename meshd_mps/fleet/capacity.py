"""A node's program capacity as Ray resources, from its daemon's real limits, and what one replica
asks of them.  Ray's scheduler places replicas against these numbers; the fleet never counts slots.

- ``meshd_slot``: the node's programs at once, summed over its GPUs, each GPU's as its daemon's
  status says it (``capacity``, from the isolation that refuses past it: in blink mode the
  context's 32 hardware queues, in MPS mode the server's 48 clients less that GPU's pool and its
  native clients); at most the mailbox's 256 slots for the whole node.
- ``meshd_gpu_<model>``: the same slots, per GPU model (its name as ``spec.resource_key`` keys it),
  for a ``gpu`` constraint.
- ``meshd_node_<name>``: the same slots again under the node's name, for a ``node`` constraint.

``slots`` lowers the node's figure (never raises it): an operator who keeps room for programs
loaded by hand, or a test that wants capacity to run out early.
"""

from __future__ import annotations

from typing import Any

from meshd_mps.base.errors import BadRequest
from meshd_mps.fleet.spec import resource_key
from meshd_mps.protocol.abi import SLOTS as MAILBOX_SLOTS

SLOT = "meshd_slot"
GPU_PREFIX = "meshd_gpu_"
NODE_PREFIX = "meshd_node_"


def per_gpu(status: dict[str, Any]) -> list[tuple[str, int]]:
    """(model, programs it runs at once) for each GPU a daemon's ``GET /v1/status`` names: its
    ``capacity``, what that GPU's isolation refuses at (``Isolation.capacity``)."""
    return [(resource_key(str(d.get("name") or status.get("device") or "gpu")), max(0, int(d.get("capacity") or 0)))
            for d in status.get("devices") or []]


def node_resources(status: dict[str, Any], *, node: str | None = None, slots: int | None = None) -> dict[str, float]:
    """The resources for ``ray start --resources`` of the node whose daemon answered ``status``;
    ``node``: the node's name (for ``ProgramSpec.node``); ``slots``: at most this many programs."""
    if slots is not None and (isinstance(slots, bool) or not isinstance(slots, int) or slots < 0):
        raise BadRequest(f"slots {slots!r}: a whole number, 0 or more")
    gpus = per_gpu(status)
    total = min(MAILBOX_SLOTS, sum(n for _m, n in gpus))
    if slots is not None:
        total = min(total, slots)
    out: dict[str, float] = {SLOT: float(total)}
    for model in {m for m, _n in gpus}:
        out[GPU_PREFIX + model] = float(min(total, sum(n for m, n in gpus if m == model)))
    if node is not None:
        key = resource_key(node)
        if not key:
            raise BadRequest(f"node {node!r}: a name with a letter or digit in it")
        out[NODE_PREFIX + key] = float(total)
    return out


def bundle(gpu: str | None = None, node: str | None = None) -> dict[str, float]:
    """What one replica asks: a slot, of a GPU of model ``gpu``, on the node named ``node``."""
    b = {SLOT: 1.0}
    if gpu is not None:
        b[GPU_PREFIX + resource_key(gpu)] = 1.0
    if node is not None:
        b[NODE_PREFIX + resource_key(node)] = 1.0
    return b


def node_name(resources: dict[str, float]) -> str | None:
    """The name a node advertises (its ``meshd_node_<name>`` key), if any."""
    for k in resources:
        if k.startswith(NODE_PREFIX):
            return k[len(NODE_PREFIX):]
    return None


def gpu_models(resources: dict[str, float]) -> tuple[str, ...]:
    return tuple(sorted(k[len(GPU_PREFIX):] for k in resources if k.startswith(GPU_PREFIX)))


def why_pending(need: dict[str, float], nodes: list[dict[str, float]], available: dict[str, float], count: int,
                strategy: str) -> str:
    """Why ``count`` replicas, each asking ``need``, have no node: the words a user acts on.
    ``nodes``: the alive nodes' total resources; ``available``: what the cluster has free."""
    gpu = next((k[len(GPU_PREFIX):] for k in need if k.startswith(GPU_PREFIX)), None)
    node = next((k[len(NODE_PREFIX):] for k in need if k.startswith(NODE_PREFIX)), None)
    kind = f" for a GPU of kind {gpu}" if gpu else ""
    where = f" on node {node}" if node else ""
    if not any(SLOT in n for n in nodes):
        return "no node of the fleet is in the cluster (no node advertises meshd_slot)"
    for k in need:
        if not any(k in n for n in nodes):
            if k.startswith(GPU_PREFIX):
                have = sorted({m for n in nodes for m in gpu_models(n)})
                return f"no node has a GPU of kind {gpu} (the fleet's: {', '.join(have) or 'none'})"
            if k.startswith(NODE_PREFIX):
                return f"no node named {node} is in the cluster"
    fitting = [n for n in nodes if all(k in n for k in need)]
    total = int(sum(min(n[k] for k in need) for n in fitting))
    free = int(min(available.get(k, 0.0) for k in need))
    if strategy == "STRICT_SPREAD" and len(fitting) < count:
        return f"STRICT_SPREAD needs {count} nodes with a free slot{kind}{where}; {len(fitting)} such nodes are in the cluster"
    return f"no node has a free slot{kind}{where} ({count} wanted, {free} free of {total})"
