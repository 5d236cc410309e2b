"""The fleet's desired state on the controller's disk, so that it outlives the Ray head.

Why a checkpoint and not Ray's GCS fault tolerance: without Redis the GCS (and Ray's internal KV)
is lost with the head, and GCS FT needs a Redis server kept beside the cluster, which every
deployment (hosts, KubeRay, Slurm) and CI would have to install and run.  The declared programs are
small and change only at deploy, upgrade and remove: one JSON file, written whole and atomically
(``state/statedir.atomic_write``) in a directory that is the user's alone (``open_state_dir``), is
enough; a controller that starts (restarted by Ray, or on a head that came back) reloads it.  The
running programs need neither: their node daemons keep them (``serve --live-restore``).

Each program's entry is its spec (desired.py, the API's) and its rollout (rollout.py, the loop's:
which image each replica is to run, where each last ran); a file of schema 1, written before the
two were apart, is read as the same.

The file also keeps the fleet's id (``id``, made at the first start and kept from then on): the
name its agents claim the node daemons by (claim.py), the same across the controller's and the
head's restarts.  One file per Ray namespace (``fleet.json`` for the CLI's, ``fleet.<namespace>.json``
for another), so that two fleets on one head never share their programs or their id.
"""

from __future__ import annotations

import json
import os
import re
import secrets
from collections.abc import Mapping
from typing import Any

from meshd_mps.base.errors import StateFileNewer, StateIOError
from meshd_mps.base.strictjson import parse_json
from meshd_mps.state.statedir import atomic_write, open_state_dir, resolve_state_dir

ENV = "MESHD_MPS_FLEET_STATE_DIR"
FILE = "fleet.json"
SCHEMA = 2
#: The namespace whose checkpoint is ``FILE`` (the CLI's, ``Fleet.connect``'s default).
NAMESPACE = "meshd-mps"


def file_name(namespace: str) -> str:
    """The checkpoint's file name for the fleet of Ray namespace ``namespace``."""
    if namespace == NAMESPACE:
        return FILE
    return f"fleet.{re.sub(r'[^A-Za-z0-9_-]', '_', namespace)}.json"


def fleet_state_dir(environ: Mapping[str, str] = os.environ) -> str:
    """``$MESHD_MPS_FLEET_STATE_DIR`` on the controller's node, else the node daemon's default
    state directory with ``-fleet`` after it (``/var/lib/meshd-mps-fleet`` for root)."""
    given = environ.get(ENV)
    return os.path.abspath(given) if given else resolve_state_dir(None, environ) + "-fleet"


class Checkpoint:
    """``fleet.json`` in the fleet's state directory: blocking, called from a thread.  ``fleet``:
    the fleet's id, read by ``load`` (a new one, saved at once, where the file has none)."""

    def __init__(self, dir: str, namespace: str = NAMESPACE):
        self.dir = open_state_dir(dir)
        self.name = file_name(namespace)
        self.path = os.path.join(self.dir, self.name)
        self.fleet = ""

    def load(self) -> dict[str, Any]:
        """The programs declared, each ``{"spec": ..., "rollout": ...}`` ({} when nothing was ever
        saved)."""
        programs = self._read()
        if not self.fleet:
            self.fleet = secrets.token_hex(4)
            self.save(programs)  # before any agent claims a node by it
        return programs

    def _read(self) -> dict[str, Any]:
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
        fleet = obj.get("fleet")
        self.fleet = fleet if isinstance(fleet, str) and fleet else ""
        programs = dict(obj["programs"])
        if schema == 1:
            programs = {n: _from_schema_1(p) for n, p in programs.items()}
        return programs

    def save(self, programs: Mapping[str, Any]) -> None:
        body = {"schema": SCHEMA, "fleet": self.fleet, "programs": programs}
        atomic_write(self.dir, self.name, json.dumps(body).encode())


def _from_schema_1(p: dict[str, Any]) -> dict[str, Any]:
    """A program of schema 1 (one record, the API's and the loop's fields together) as a spec and
    a rollout."""
    spec = {k: p.get(k) for k in ("name", "replicas", "restart", "strategy", "gpu", "node", "image", "generation",
                                  "token")}
    spec["previous"] = p.get("old")
    rollout = {"assigned": p.get("assigned"), "target": p["image"]["hash"], "generation": p.get("generation"),
               "error": p.get("upgrade_error"), "where": p.get("where")}
    return {"spec": spec, "rollout": rollout}
