"""deploy/kubernetes/: every manifest checked against the schemas a cluster would check it against
(the core kinds with kubernetes-validate, strictly: an unknown field is an error; the RayCluster
against KubeRay's CRD schema, vendored in tests/data/kuberay/, and its pod templates as core
PodTemplates), and what the docs promise of them: the node daemon's state dir on the node (a
hostPath), ``serve --live-restore`` in the fleet's worker pods with flags serve really takes, and
``ray start`` given the resources ``meshd-mps fleet resources`` prints."""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from meshd_mps.serving import cli as node_cli

ROOT = Path(__file__).resolve().parents[2]
MANIFESTS = ROOT / "deploy" / "kubernetes"
RAYCLUSTER_SCHEMA = Path(__file__).resolve().parents[1] / "data" / "kuberay" / "raycluster-v1.schema.yaml"
#: The Kubernetes release whose schemas the core kinds are checked against (kubernetes-validate's).
K8S = "1.30"


def docs(name: str) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all((MANIFESTS / name).read_text()) if d is not None]


def raycluster() -> dict[str, Any]:
    (doc,) = docs("raycluster.yaml")
    return doc


def core_valid(doc: dict[str, Any]) -> None:
    kubernetes_validate.validate(doc, K8S, strict=True)


def as_pod_template(template: dict[str, Any], name: str) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": name}, "template": template}


def container(spec: dict[str, Any], name: str) -> dict[str, Any]:
    (c,) = [c for c in spec["containers"] if c["name"] == name]
    return c


def host_path_of(spec: dict[str, Any], c: dict[str, Any], directory: str) -> str:
    """The node's path behind the container's ``directory`` (a hostPath volume mounted at it or above it)."""
    volumes = {v["name"]: v for v in spec.get("volumes", [])}
    for m in c.get("volumeMounts", []):
        if directory == m["mountPath"] or directory.startswith(m["mountPath"].rstrip("/") + "/"):
            v = volumes[m["name"]]
            assert "hostPath" in v, f"{directory} is on volume {m['name']}, not a hostPath: {v}"
            return v["hostPath"]["path"] + directory[len(m["mountPath"]):]
    raise AssertionError(f"{directory}: not on any volume of container {c['name']}: inside the container")


def serve_args(c: dict[str, Any]) -> Any:
    """The container's command line as ``meshd-mps serve`` parses and checks it (the flags real, the
    values accepted), without starting anything."""
    assert c["command"] == ["meshd-mps"], "meshd-mps must be the container's main process (the kubelet's SIGTERM)"
    args = node_cli.parser().parse_args(c["args"])
    assert args.cmd == "serve"
    return node_cli.serve_config(args)


# ---- every manifest, against the schemas ---------------------------------------------------------


def test_every_manifest_is_checked():
    """A manifest added to deploy/kubernetes/ is one of those the tests below read."""
    assert sorted(p.name for p in MANIFESTS.glob("*.yaml")) == ["daemonset.yaml", "fleet-state.yaml", "raycluster.yaml"]


def test_daemonset_is_a_valid_daemonset():
    (doc,) = docs("daemonset.yaml")
    assert doc["kind"] == "DaemonSet"
    core_valid(doc)


def pruned(doc: Any, schema: dict[str, Any], at: str = "") -> list[str]:
    """The fields of ``doc`` that the API server would drop without a word (a structural schema
    prunes what its ``properties`` do not name, unless it keeps unknown fields): a misspelt key."""
    if schema.get("x-kubernetes-preserve-unknown-fields"):
        return []
    out: list[str] = []
    if isinstance(doc, dict) and "properties" in schema:
        for k, v in doc.items():
            if k in schema["properties"]:
                out += pruned(v, schema["properties"][k], f"{at}.{k}")
            elif not at and k in ("apiVersion", "kind", "metadata"):
                continue  # the object's own: the API server's schema, not the CRD's
            else:
                out.append(f"{at}.{k}")
    elif isinstance(doc, dict) and isinstance(schema.get("additionalProperties"), dict):
        for k, v in doc.items():
            out += pruned(v, schema["additionalProperties"], f"{at}.{k}")
    elif isinstance(doc, list) and isinstance(schema.get("items"), dict):
        for i, v in enumerate(doc):
            out += pruned(v, schema["items"], f"{at}[{i}]")
    return out


def check_raycluster(doc: dict[str, Any]) -> None:
    schema = yaml.safe_load(RAYCLUSTER_SCHEMA.read_text())
    jsonschema.validate(doc, schema, cls=jsonschema.Draft7Validator)
    assert not pruned(doc, schema), f"fields KubeRay's schema does not know (the API server drops them): {pruned(doc, schema)}"


def test_fleet_state_claim_is_a_valid_claim():
    (doc,) = docs("fleet-state.yaml")
    assert doc["kind"] == "PersistentVolumeClaim"
    core_valid(doc)


def test_raycluster_matches_kuberays_schema():
    doc = raycluster()
    assert (doc["apiVersion"], doc["kind"]) == ("ray.io/v1", "RayCluster")
    check_raycluster(doc)


def test_raycluster_pods_are_valid_pod_templates():
    """The CRD's schema leaves parts of a pod open; the core schema, strictly, does not."""
    spec = raycluster()["spec"]
    core_valid(as_pod_template(spec["headGroupSpec"]["template"], "head"))
    for group in spec["workerGroupSpecs"]:
        core_valid(as_pod_template(group["template"], group["groupName"]))


def test_the_schemas_refuse_a_broken_manifest():
    """The checks above can fail: a misspelt field, a wrong type, a missing required one."""
    doc = raycluster()
    doc["spec"]["workerGroupSpecs"][0]["replicas"] = "two"
    with pytest.raises(jsonschema.ValidationError):
        check_raycluster(doc)
    doc = raycluster()
    del doc["spec"]["headGroupSpec"]["template"]
    with pytest.raises(jsonschema.ValidationError):
        check_raycluster(doc)
    doc = raycluster()
    doc["spec"]["workerGroupSpecs"][0]["rayStartParam"] = {}  # for rayStartParams
    with pytest.raises(AssertionError, match=r"\.spec\.workerGroupSpecs\[0\]\.rayStartParam"):
        check_raycluster(doc)
    (ds,) = docs("daemonset.yaml")
    ds["spec"]["template"]["spec"]["containers"][0]["volumeMount"] = []  # for volumeMounts
    with pytest.raises(kubernetes_validate.ValidationError):
        core_valid(ds)
    worker = raycluster()["spec"]["workerGroupSpecs"][0]["template"]
    worker["spec"]["volumes"][1]["hostPath"]["type"] = 7
    with pytest.raises(kubernetes_validate.ValidationError):
        core_valid(as_pod_template(worker, "gpu"))


# ---- what docs/fleet.md and docs/operations.md promise of them ------------------------------------


def test_daemonset_keeps_its_state_on_the_node():
    (doc,) = docs("daemonset.yaml")
    spec = doc["spec"]["template"]["spec"]
    c = container(spec, "meshd-mps")
    cfg = serve_args(c)
    assert host_path_of(spec, c, cfg.state_dir).startswith("/var/lib/meshd-mps")
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 1


def test_fleet_worker_runs_the_node_daemon_with_live_restore_and_its_state_on_the_node():
    spec = raycluster()["spec"]["workerGroupSpecs"][0]["template"]["spec"]
    c = container(spec, "meshd-mps")
    cfg = serve_args(c)
    assert cfg.live_restore is True
    assert host_path_of(spec, c, cfg.state_dir).startswith("/var/lib/meshd-mps")
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 1
    # The Ray container reaches the daemon on the socket it serves, through a volume both mount.
    ray = spec["containers"][0]
    env = {e["name"]: e.get("value") for e in ray["env"]}
    assert env["MESHD_MPS_SOCKET"] == cfg.socket
    shared = {m["name"] for m in ray["volumeMounts"]} & {m["name"] for m in c["volumeMounts"]}
    assert any(cfg.socket.startswith(m["mountPath"] + "/") for m in ray["volumeMounts"] if m["name"] in shared)


def test_fleet_head_keeps_the_declared_programs_on_a_claim():
    """The controller's checkpoint (MESHD_MPS_FLEET_STATE_DIR of the head) on fleet-state.yaml's
    claim: it outlives the head pod."""
    pytest.importorskip("ray")
    from meshd_mps.fleet.checkpoint import ENV

    spec = raycluster()["spec"]["headGroupSpec"]["template"]["spec"]
    head = spec["containers"][0]
    state = {e["name"]: e["value"] for e in head["env"]}[ENV]
    (claim,) = docs("fleet-state.yaml")
    volumes = {v["name"]: v for v in spec["volumes"]}
    (mount,) = [m for m in head["volumeMounts"] if state.startswith(m["mountPath"].rstrip("/") + "/")]
    assert volumes[mount["name"]]["persistentVolumeClaim"]["claimName"] == claim["metadata"]["name"]
    assert state != mount["mountPath"], "a subdirectory, made 0700: a volume's root may be group-writable"


def test_fleet_worker_starts_ray_with_the_daemons_resources():
    doc = raycluster()
    assert doc["metadata"]["annotations"]["ray.io/overwrite-container-cmd"] == "true"
    spec = doc["spec"]["workerGroupSpecs"][0]["template"]["spec"]
    ray = spec["containers"][0]  # KubeRay's Ray container is the pod's first
    assert ray["name"] == "ray-worker"
    assert ray["command"][:2] == ["/bin/bash", "-c"]
    script = ray["args"][-1]
    assert "$KUBERAY_GEN_RAY_START_CMD --resources" in script
    words = shlex.split(script.split("until ", 1)[1].split(";", 1)[0])
    assert words == ["meshd-mps", "fleet", "resources", "--node", "$NODE_NAME"]
    (name,) = [e for e in ray["env"] if e["name"] == "NODE_NAME"]
    assert name["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName", "the node's name, not the pod's"
    assert "nvidia.com/gpu" not in ray.get("resources", {}).get("limits", {}), "the GPU is the daemon's"


def test_fleet_resources_is_a_command_the_fleet_cli_takes():
    """The line the worker pod runs parses as `meshd-mps fleet resources` (where Ray is installed)."""
    pytest.importorskip("ray")
    from meshd_mps.fleet import cli as fleet_cli

    args = fleet_cli.parser().parse_args(["resources", "--node", "gpu-node-7"])
    assert (args.cmd, args.socket, args.node) == ("resources", None, "gpu-node-7")
