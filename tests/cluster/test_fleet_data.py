"""A program's data on the fleet (docs/fleet.md, "Data"), on the fleet tests' shared cluster
(tests/rigs/fleet.py): ``Fleet.deploy`` of peek with a data file puts it once into Ray's object
store; each node's agent takes it from there and streams it to its daemon, whose replica reads it."""

from __future__ import annotations

import hashlib
import os
import struct

import pytest

from meshd_mps.fleet import ProgramSource, ProgramSpec
from meshd_mps.fleet.spec import replica_name

from ..rigs import fleet as shared
from ..rigs.fleet import UP_S
from ..rigs.serve import EXAMPLES

fleet_rig, fleet = shared.fleet_rig, shared.fleet  # tests/rigs/fleet.py

pytestmark = pytest.mark.timeout(240)


async def test_deploy_with_data_reaches_every_node_through_the_object_store(fleet_rig, fleet, tmp):
    data = os.urandom(64 << 10)
    path = os.path.join(tmp, "table.bin")
    with open(path, "wb") as f:
        f.write(data)
    src = ProgramSource.read(str(EXAMPLES / "peek"), data=path)
    await fleet.deploy(ProgramSpec("peek", src, replicas=3))
    p = await fleet.wait("peek", running=3, timeout=UP_S)
    key = hashlib.sha256(data).hexdigest()
    for r in p.replicas:  # each node's daemon holds the data by its key, and its replica owns it
        node = next(n for n in fleet_rig.nodes.values() if n.id == r.node)
        assert os.path.getsize(os.path.join(node.state, "data", key)) == len(data)
        row = node.ps()[replica_name("peek", r.index)]
        assert (row["data"], row["data_bytes"]) == (key, len(data))
    for off in (0, 4096, len(data) - 100):
        reply = await fleet.call("peek", struct.pack("<QI", off, 100))
        size, seq, total = struct.unpack_from("<QII", reply.data)
        assert (size, seq, total, reply.data[16:]) == (len(data), 0, sum(data[off:off + 100]), data[off:off + 100])
