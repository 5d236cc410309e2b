"""The fleet's desired state on the controller's disk, so that it outlives the Ray head.

Why a checkpoint and not Ray's GCS fault tolerance: without Redis the GCS (and Ray's internal KV)
is lost with the head, and GCS FT needs a Redis server kept beside the cluster, which every
deployment (hosts, KubeRay, Slurm) and CI would have to install and run.  The declared programs are
small and change only at deploy, upgrade and remove: one JSON file, written whole and atomically
(``state/statedir.atomic_write``) in a directory that is the user's alone (``open_state_dir``), is
enough; a controller that starts (restarted by Ray, or on a head that came back) reloads it.  The
running programs need neither: their node daemons keep them (``serve --live-restore``).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any

from meshd_mps.errors import StateFileNewer, StateIOError
from meshd_mps.state.statedir import atomic_write, open_state_dir, resolve_state_dir
from meshd_mps.strictjson import parse_json

ENV = "MESHD_MPS_FLEET_STATE_DIR"
FILE = "fleet.json"
SCHEMA = 1


def fleet_state_dir(environ: Mapping[str, str] = os.environ) -> str:
    """``$MESHD_MPS_FLEET_STATE_DIR`` on the controller's node, else the node daemon's default
    state directory with ``-fleet`` after it (``/var/lib/meshd-mps-fleet`` for root)."""
    given = environ.get(ENV)
    return os.path.abspath(given) if given else resolve_state_dir(None, environ) + "-fleet"


class Checkpoint:
    """``fleet.json`` in the fleet's state directory: blocking, called from a thread."""

    def __init__(self, dir: str):
        self.dir = open_state_dir(dir)
        self.path = os.path.join(self.dir, FILE)

    def load(self) -> dict[str, Any]:
        """The programs declared ({} when nothing was ever saved)."""
        try:
            with open(self.path, "rb") as f:
                raw = f.read()
        except FileNotFoundError:
            return {}
        except OSError as e:
            raise StateIOError(f"fleet state: {self.path}: {e.strerror or e}", file=self.path,
                               why=e.strerror or str(e)) from e
        try:
            obj = parse_json(raw)
        except ValueError as e:
            raise StateIOError(f"fleet state: {self.path}: not JSON: {e}", file=self.path, why=str(e)) from e
        if not isinstance(obj, dict) or not isinstance(obj.get("programs"), dict):
            raise StateIOError(f"fleet state: {self.path}: no programs table", file=self.path, why="no programs table")
        schema = obj.get("schema")
        if isinstance(schema, int) and schema > SCHEMA:
            raise StateFileNewer(f"fleet state: {self.path}: schema {schema}, this meshd-mps reads {SCHEMA}",
                                 file=self.path, schema=schema, supported=SCHEMA)
        return dict(obj["programs"])

    def save(self, programs: Mapping[str, Any]) -> None:
        atomic_write(self.dir, FILE, json.dumps({"schema": SCHEMA, "programs": programs}).encode())
