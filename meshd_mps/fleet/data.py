"""A program's data on the fleet (docs/fleet.md, "Data"): in Ray's object store, owned by the
controller, so that it lives as long as the program is declared, whoever deployed it.

The deploying client puts the file once (``Fleet.deploy``: through a memory map, no copy in its
memory) and hands the controller the ObjectRef.  An object is owned by the process that put it, and
Ray (2.56 on) no longer lets a put name another owner: the client's object dies with the client.
So the controller makes its own (``owned``): a task on the client's node returns the object as it
is, and the task's return, stored in that node's object store, is the controller's.  The bytes go
from the object store to the task (a zero-copy view) and back into the store, on that node; never
through the controller's memory or the head's disk, which keeps only the ref (not even the ref
outlives the controller: its checkpoint holds no data, docs/fleet.md).  Each node's agent then
reads the object from its own node's store (fetched once per node) and streams it to its daemon.
"""

from __future__ import annotations

import asyncio
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy


@ray.remote(num_cpus=0, max_retries=0)
def _returned(arr: Any) -> Any:
    return arr


async def owned(image: dict[str, Any]) -> dict[str, Any]:
    """``image`` with its data (if any) as an object the caller (the controller) owns, once stored."""
    ref = image.get("data")
    if ref is None:
        return image
    node = image.get("data_node")
    opts: dict[str, Any] = {}
    if node:
        opts["scheduling_strategy"] = NodeAffinitySchedulingStrategy(node, soft=True)
    mine = _returned.options(**opts).remote(ref)
    # Stored (then the client may go), its value not fetched here: never the bytes in this process.
    await asyncio.to_thread(ray.wait, [mine], num_returns=1, fetch_local=False)
    return {**image, "data": mine}
