"""A user's own program, as a new user writes it from docs/program-abi.md: a counter on the
request ring (each answer is the running total of the numbers sent), and a folder for it that
``meshd-mps load`` and ``meshd-mps check`` take.  Not an example: the simulated GPU never runs it,
whatever it is called."""

from __future__ import annotations

import json
from pathlib import Path

#: A counter: echo's loop, with its answers changed (the running total of each request's first word).
COUNTER_CU = r"""#include "mesh_program.h"

MESH_DEFINE_RT_ABI();

MESH_MAIN {
    if (blockIdx.x != 0 || threadIdx.x >= 32)
        return;
    mesh_slot_t s = mesh_slot(mailbox, slot);
    mesh_ring_t r;
    mesh_ring_init(s, &r, MESH_BEAT_EVERY);
    if (threadIdx.x == 0)
        mesh_set_state(s, MESH_RUNNING);
    unsigned int total = 0, n;
    while ((n = mesh_ring_wait(&r)) != 0) {
        for (unsigned int k = 0; k < n; k++) {
            mesh_entry_t e = mesh_ring_load(&r, r.next + k);
            total += __shfl_sync(MESH_WARP, e.lo, 1);
            e.lo = total;
            mesh_ring_store(&r, r.next + k, e, 4);
        }
        mesh_ring_post(&r, n);
    }
    if (threadIdx.x == 0)
        mesh_set_state(s, MESH_EXITED);
}
"""


def program_dir(root: str | Path, name: str, source: str = COUNTER_CU, file: str = "counter.cu", **manifest: object) -> Path:
    """A program folder ``root/name``: manifest.json (name ``name``, one warp, ABI 1, and
    ``manifest``'s fields) and ``file`` holding ``source``."""
    d = Path(root) / name
    d.mkdir(parents=True)
    (d / "manifest.json").write_text(json.dumps({"name": name, "backend": "cuda", "warps": 1, "abi": 1, **manifest}))
    (d / file).write_text(source)
    return d
