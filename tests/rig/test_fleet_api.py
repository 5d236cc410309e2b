"""The fleet's pieces that need no cluster: the spec's checks, the capacity's words, the rolling
upgrade's budget (``Rollout.step``), the checkpoint (and one of the schema before the spec and
the rollout were apart), and the fleet without Ray or without a cluster."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from meshd_mps.base.errors import BadName, BadRestartPolicy, BadSpec, ManifestError, StateFileNewer
from meshd_mps.fleet.capacity import bundle, why_pending
from meshd_mps.fleet.checkpoint import Checkpoint
from meshd_mps.fleet.desired import Image, Spec
from meshd_mps.fleet.rollout import Rollout
from meshd_mps.fleet.spec import ProgramSource, ProgramSpec, parse_replica_name, replica_name, resource_key

from ..rigs.serve import EXAMPLES, env

ECHO = ProgramSource.read(str(EXAMPLES / "echo"))


@pytest.mark.parametrize("spec, err, field", [
    (ProgramSpec("echo", ECHO, replicas=0), BadSpec, "replicas"),
    (ProgramSpec("echo", ECHO, replicas=True), BadSpec, "replicas"),  # type: ignore[arg-type]
    (ProgramSpec("echo", ECHO, strategy="RANDOM"), BadSpec, "strategy"),  # type: ignore[arg-type]
    (ProgramSpec("e" * 55, ECHO), BadSpec, "name"),
    (ProgramSpec("echo", ECHO, hash="0" * 16), BadSpec, "hash"),
    (ProgramSpec("echo", ECHO, gpu="--"), BadSpec, "gpu"),
    (ProgramSpec("echo", "echo/"), BadSpec, "source"),  # type: ignore[arg-type]
    (ProgramSpec("echo", ECHO, restart="sometimes"), BadRestartPolicy, None),
    (ProgramSpec("no/slash", ECHO), BadName, None),
    (ProgramSpec("echo", ProgramSource({"name": "echo"}, ECHO.ptx)), ManifestError, None),
])
def test_a_spec_that_cannot_be_deployed_is_refused_naming_the_field(spec, err, field):
    with pytest.raises(err) as e:
        spec.check()
    if field is not None:
        assert e.value.field == field
    ProgramSpec("echo", ECHO, replicas=3, strategy="STRICT_SPREAD", gpu="H200", node="n1", hash=ECHO.hash).check()


def test_names_and_keys():
    assert replica_name("echo", 12) == "echo.fleet-12" and parse_replica_name("echo.fleet-12") == ("echo", 12)
    assert parse_replica_name("echo") is None and parse_replica_name("echo.fleet-x") is None
    assert resource_key("NVIDIA H200") == "h200"
    assert resource_key("simulated NVIDIA H200 (meshd-mps --gpu sim)") == "simulated_h200"
    assert bundle("H100 80GB", "gpu-box-1") == {"meshd_slot": 1.0, "meshd_gpu_h100_80gb": 1.0, "meshd_node_gpu_box_1": 1.0}


def test_why_pending_says_what_is_missing():
    nodes = [{"meshd_slot": 2.0, "meshd_gpu_h200": 2.0, "meshd_node_a": 2.0}, {"meshd_slot": 2.0, "meshd_gpu_h200": 2.0}]
    assert why_pending(bundle(), nodes, {"meshd_slot": 1.0}, 3, "PACK") == "no node has a free slot (3 wanted, 1 free of 4)"
    assert why_pending(bundle("h100"), nodes, {}, 1, "SPREAD") == "no node has a GPU of kind h100 (the fleet's: h200)"
    assert why_pending(bundle(None, "b"), nodes, {}, 1, "SPREAD") == "no node named b is in the cluster"
    assert why_pending(bundle(), nodes, {"meshd_slot": 4.0}, 3, "STRICT_SPREAD") == \
        "STRICT_SPREAD needs 3 nodes with a free slot; 2 such nodes are in the cluster"
    assert why_pending(bundle(), [{"CPU": 1.0}], {}, 1, "SPREAD").startswith("no node of the fleet")


V1, V2 = Image({}, "v1", "1" * 16), Image({}, "v2", "2" * 16)


def rollout(replicas: int = 3) -> Rollout:
    s = Spec("echo", replicas, "on-failure", "SPREAD", V1).upgraded(V2)
    r = Rollout.start(Spec("echo", replicas, "on-failure", "SPREAD", V1))
    r.follow(s)
    return r


def test_a_rolling_upgrade_drains_one_replica_at_a_time_and_waits_for_it_to_run():
    d = rollout()
    old, new = "1" * 16, "2" * 16
    up = [True] * 3
    d.step(up, [old] * 3, drain=1.0, now=0.0)
    assert d.draining == 0 and d.assigned == [old] * 3, "drained first, still on the old image"
    d.step(up, [old] * 3, drain=1.0, now=0.5)
    assert d.assigned == [old] * 3
    d.step(up, [old] * 3, drain=1.0, now=1.0)
    assert d.assigned == [new, old, old] and d.draining is None
    d.step([False, True, True], [None, old, old], drain=1.0, now=2.0)
    assert d.draining is None, "the next waits while replica 0 starts on the new image"
    d.step(up, [new, old, old], drain=1.0, now=3.0)
    assert d.draining == 1
    d.step(up, [new, old, old], drain=1.0, now=4.0)
    d.step(up, [new, new, old], drain=1.0, now=5.0)
    d.step(up, [new, new, old], drain=1.0, now=6.0)
    d.step(up, [new, new, new], drain=1.0, now=7.0)
    assert d.assigned == [new] * 3 and not d.upgrading


def test_replicas_not_running_take_the_new_image_at_once_and_a_refusal_rolls_back():
    d = rollout()
    old, new = "1" * 16, "2" * 16
    d.step([True, False, True], [old, None, old], drain=1.0, now=0.0)
    assert d.assigned == [old, new, old] and d.draining == 0
    d.roll_back(Spec("echo", 3, "on-failure", "SPREAD", V1).upgraded(V2), "refused")
    assert d.target == old and d.error == "refused" and d.draining is None
    d.step([True, False, True], [old, None, old], drain=1.0, now=1.0)
    assert d.assigned == [old, old, old]


def test_the_checkpoint_keeps_the_declared_programs_and_reads_the_schema_before(tmp):
    s = Spec("echo", 3, "on-failure", "SPREAD", V1, unique=True).upgraded(V2)
    d = rollout()
    d.where = ["n0", None, "n2"]
    c = Checkpoint(os.path.join(tmp, "fleet"))
    assert c.load() == {}
    c.save({"echo": {"spec": s.to_json(), "rollout": d.to_json()}})
    got = Checkpoint(os.path.join(tmp, "fleet")).load()["echo"]
    back = Spec.from_json(got["spec"])
    assert back == s and back.pg_prefix == s.pg_prefix and back.unique
    r = Rollout.from_json(got["rollout"], back)
    assert r.kept() == d.kept() and r.owner == ["?"] * 3, "a unique replica's owner is not known after a start"
    assert back.bundle(r.where[0]) == {"meshd_slot": 1.0, "meshd_node_n0": 1.0}
    # Schema 1: one record per program, the API's and the loop's fields together.
    v1 = {"name": "echo", "replicas": 2, "restart": "always", "strategy": "PACK", "gpu": None, "node": None,
          "image": V2.to_json(), "generation": 2, "assigned": ["1" * 16, "2" * 16], "old": V1.to_json(),
          "upgrade_error": None, "where": ["n0", "n1"], "pins": [None, None], "token": "abcd0123"}
    with open(c.path, "w") as f:
        f.write(json.dumps({"schema": 1, "fleet": "f1", "programs": {"echo": v1}}))
    got = Checkpoint(os.path.join(tmp, "fleet")).load()["echo"]
    back = Spec.from_json(got["spec"])
    assert (back.image, back.previous, back.generation, back.token, back.unique) == (V2, V1, 2, "abcd0123", False)
    r = Rollout.from_json(got["rollout"], back)
    assert (r.assigned, r.target, r.where) == (["1" * 16, "2" * 16], V2.hash, ["n0", "n1"])
    with open(c.path, "w") as f:
        f.write('{"schema": 99, "programs": {}}')
    with pytest.raises(StateFileNewer):
        c.load()


def test_without_ray_the_fleet_says_how_to_get_it():
    code = ("import sys; sys.modules['ray'] = None\n"
            "from meshd_mps.base.errors import FleetUnavailable\n"
            "try:\n    import meshd_mps.fleet\nexcept FleetUnavailable as e:\n    print(e.hint)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env(), timeout=60)
    assert out.stdout.strip() == "pip install 'meshd-mps[fleet]'", out.stderr


def test_the_fleets_errors_cross_ray_whole():
    import pickle

    from meshd_mps.base.errors import AlreadyDeclared, FleetTimeout, NoSuchProgram

    for e in (NoSuchProgram("echo"), AlreadyDeclared("echo"), BadSpec("replicas 0: no", field="replicas"),
              FleetTimeout("echo: 1 of 3", program="echo", running=1, wanted=3)):
        back = pickle.loads(pickle.dumps(e))
        assert type(back) is type(e) and str(back) == str(e) and back.fields() == e.fields()
