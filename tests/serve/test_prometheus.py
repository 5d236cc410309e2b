"""The dashboard and the alerts, checked by the real thing: a real Prometheus (Debian's package, with
promtool) scraping two ``--gpu sim`` daemons (MPS mode with the stand-in MPS daemon, and blink mode)
over ``serve --metrics-address``, and the fleet's metrics as ``meshd-mps fleet metrics`` prints them
(a fleet's status with a replica pending, served over HTTP as a textfile exporter would).  Every
panel query of deploy/grafana/meshd-mps.json returns data through Prometheus' HTTP API, and every
alert of deploy/prometheus/alerts.yml fires once its condition is made true on the simulated GPU (a
stalled program, a GPU fault, a crash loop, calls that fail, a pool with no worker for a load, a
fleet replica pending); ``promtool check rules`` passes on the file as shipped."""

from __future__ import annotations

import json
import math
import os
import re
import signal
import socket
import subprocess
import threading
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import yaml

from meshd_mps.base.errors import ConfigError, ConfigFileError
from meshd_mps.serving.client import ClientError, program_body
from meshd_mps.state.config import load_config, metrics_address

from ..rigs.serve import EXAMPLES, REPO, cli
from ..rigs.tools import need
from ..rigs.waits import poll

pytestmark = pytest.mark.timeout(240)

DASHBOARD = REPO / "deploy" / "grafana" / "meshd-mps.json"
ALERTS = REPO / "deploy" / "prometheus" / "alerts.yml"
#: What Grafana puts in a panel's query: every daemon, and a rate window over the whole test (scrapes every 0.5 s).
VARIABLES = {"$__rate_interval": "1m", "$instance": ".*"}
UP_S = 60.0


def panels(dash: dict) -> Iterator[dict]:
    for p in dash["panels"]:
        yield from panels(p) if p.get("type") == "row" and p.get("panels") else [p] if p.get("type") != "row" else []


def expr_of(target: dict) -> str:
    e = target["expr"]
    for k, v in VARIABLES.items():
        e = e.replace(k, v)
    assert "$" not in e, f"a variable the test does not give: {e}"
    return e


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Prom:
    """A Prometheus server of the test's own (its TSDB in the test's directory), on its HTTP API."""

    def __init__(self, binary: str, dir: str, targets: dict[str, list[str]], rules: str):
        self.url = f"http://127.0.0.1:{free_port()}"
        self.fired: set[str] = set()
        config = {"global": {"scrape_interval": "500ms", "evaluation_interval": "500ms", "scrape_timeout": "450ms"},
                  "rule_files": [rules],
                  "scrape_configs": [{"job_name": job, "static_configs": [{"targets": t}]} for job, t in targets.items()]}
        path = os.path.join(dir, "prometheus.yml")
        Path(path).write_text(yaml.safe_dump(config))
        self.log = open(os.path.join(dir, "prometheus.log"), "wb")  # noqa: SIM115 (closed in stop)
        self.proc = subprocess.Popen([binary, f"--config.file={path}", f"--storage.tsdb.path={dir}/tsdb",
                                      f"--web.listen-address={self.url.removeprefix('http://')}", "--log.level=warn"],
                                     stdout=self.log, stderr=subprocess.STDOUT)
        poll(self.ready, UP_S, lambda: f"Prometheus ready at {self.url}: {self.logged()}", every=0.1)

    def logged(self) -> str:
        return Path(self.log.name).read_text(errors="replace")[-3000:]

    def ready(self) -> bool:
        assert self.proc.poll() is None, f"prometheus exited {self.proc.returncode}: {self.logged()}"
        try:
            with urllib.request.urlopen(f"{self.url}/-/ready", timeout=5) as r:
                return r.status == 200
        except OSError:
            return False

    def api(self, path: str, **params: str) -> Any:
        q = f"?{urllib.parse.urlencode(params)}" if params else ""
        with urllib.request.urlopen(f"{self.url}/api/v1/{path}{q}", timeout=10) as r:
            body = json.loads(r.read())
        assert body["status"] == "success", body
        return body["data"]

    def query(self, expr: str) -> list[dict]:
        data = self.api("query", query=expr)
        assert data["resultType"] == "vector", (expr, data)
        return data["result"]

    def firing(self) -> set[str]:
        """The alerts firing now, added to ``fired`` (every alert seen firing so far)."""
        now = {a["labels"]["alertname"] for a in self.api("alerts")["alerts"] if a["state"] == "firing"}
        self.fired |= now
        return now

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(30)
        self.log.close()


def fleet_exporter() -> tuple[ThreadingHTTPServer, str]:
    """``meshd-mps fleet metrics``' exposition of a fleet whose program has a replica running (with
    its calls) and one pending, served on /metrics (a textfile exporter's part)."""
    from meshd_mps.fleet.metrics import CONTENT_TYPE, exposition
    from meshd_mps.fleet.spec import FleetProgram, FleetStatus, NodeView, ReplicaView

    n0 = "0" * 56
    calls = {"total": 3, "outcomes": {"ok": 3}, "bytes_in": 12, "bytes_out": 12, "counts": [0, 0, 0, 0, 3] + [0] * 16,
             "seconds": 2e-4}
    echo = FleetProgram("echo", (ReplicaView("echo", 0, "running", node=n0, node_name="n0", hash="h" * 16, calls=calls,
                                             heartbeat_age=0.1),
                                 ReplicaView("echo", 1, "pending", reason="no node has a free slot")),
                        wanted=2, hash="h" * 16, generation=1, restart="on-failure", strategy="SPREAD")
    body = exposition(FleetStatus((echo,), (NodeView(n0, "n0", True, "up", slots=1, replicas=1),),
                                  fleet={"id": "f1", "namespace": "meshd-mps", "cluster": "c"}, tick_age=0.2))

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # http.server calls it by this name
            self.send_response(200)
            self.send_header("Content-Type", CONTENT_TYPE)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"127.0.0.1:{server.server_address[1]}"


def rules_firing_at_once(dir: str) -> str:
    """The shipped rules, each alert's ``for`` 0s: the test waits for the condition, not an hour."""
    doc = yaml.safe_load(ALERTS.read_text())
    for g in doc["groups"]:
        for r in g["rules"]:
            r["for"] = "0s"
    path = os.path.join(dir, "alerts-now.yml")
    Path(path).write_text(yaml.safe_dump(doc))
    return path


@pytest.mark.parametrize(("text", "got"), [("9464", ("127.0.0.1", 9464)), (":9464", ("127.0.0.1", 9464)),
                                           ("0.0.0.0:9464", ("0.0.0.0", 9464)), ("[::1]:0", ("::1", 0)),
                                           ("gpu-1.example:80", ("gpu-1.example", 80))])
def test_a_metrics_address(text, got):
    assert metrics_address(text) == got


@pytest.mark.parametrize(("text", "why"), [("::1:9464", "an IPv6 address goes in brackets"), ("host:", "HOST:PORT or PORT"),
                                          ("host:65536", "HOST:PORT or PORT expected, the port a number from 0 to 65535"),
                                          ("9464x", "HOST:PORT or PORT"), ("a b:1", "the host is a name or an address"),
                                          ("", "HOST:PORT or PORT")])
def test_a_metrics_address_that_cannot_work_is_refused(text, why):
    with pytest.raises(ConfigError, match=re.escape(f"--metrics-address {text!r}: {why}")):
        metrics_address(text, "--metrics-address")


def test_serve_and_its_config_file_refuse_a_metrics_address_that_cannot_work(tmp):
    r = cli("serve", "--gpu", "sim", "--socket", f"{tmp}/s.sock", "--metrics-address", "::1:9464")
    assert (r.returncode, r.stderr) == (2, "meshd-mps: --metrics-address '::1:9464': an IPv6 address goes in brackets:"
                                           " [::1]:9400\n"), r
    (Path(tmp) / "serve.toml").write_text('[serve]\nmetrics_address = "host:65536"\n')
    with pytest.raises(ConfigFileError, match=re.escape("a number from 0 to 65535")) as e:
        load_config(f"{tmp}/serve.toml")
    assert e.value.key == "serve.metrics_address" and e.value.line == 2


def test_a_metrics_port_in_use_stops_the_start_before_anything_runs(tmp):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        r = cli("serve", "--gpu", "sim", "--socket", f"{tmp}/s.sock", "--state-dir", f"{tmp}/state",
                "--metrics-address", str(port))
    assert r.returncode == 1, r
    assert f"meshd-mps: --metrics-address 127.0.0.1:{port}: bind: Address already in use" in r.stderr, r.stderr
    assert not os.path.exists(f"{tmp}/s.sock")


def test_promtool_checks_the_rules_and_the_dashboard_is_grafanas():
    promtool = need("promtool")["promtool"]
    r = subprocess.run([promtool, "check", "rules", str(ALERTS)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "SUCCESS: 6 rules found" in r.stdout, r.stdout + r.stderr
    dash = json.loads(DASHBOARD.read_text())
    assert dash["uid"] == "meshd-mps" and dash["schemaVersion"] >= 36
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids)), "every panel's id its own"
    names = {v["name"] for v in dash["templating"]["list"]}
    assert names == {"datasource", "instance"}
    for p in panels(dash):
        assert p["targets"] and p["datasource"]["uid"] == "${datasource}", p["title"]
        assert all(t["datasource"]["uid"] == "${datasource}" for t in p["targets"]), p["title"]


def test_every_panel_and_alert_on_a_real_prometheus(serve, standin_on_path, tmp):
    binary = need("prometheus")["prometheus"]
    mps = serve("mps", "--pool", "2", "--stall-after", "0.5", "--metrics-address", "0", sock=os.path.join(tmp, "m.sock"))
    blink = serve("blink", "--metrics-address", "127.0.0.1:0", sock=os.path.join(tmp, "b.sock"))
    addresses = [s.wait_ready()["metrics_address"] for s in (mps, blink)]
    assert all(re.fullmatch(r"127\.0\.0\.1:\d+", a) for a in addresses), addresses
    with urllib.request.urlopen(f"http://{addresses[0]}/", timeout=10) as r:  # where the metrics are, as exporters say
        assert r.read() == b"meshd-mps: the daemon's metrics are at /metrics\n"
    with pytest.raises(urllib.error.HTTPError) as e:  # the metrics only: no control route over TCP
        urllib.request.urlopen(f"http://{addresses[0]}/v1/status", timeout=10)
    assert e.value.code == 404
    fleet, fleet_at = fleet_exporter()
    prom = Prom(binary, tmp, {"meshd-mps": addresses, "meshd-mps-fleet": [fleet_at]}, rules_firing_at_once(tmp))
    try:
        poll(lambda: {t["health"] for t in prom.api("targets")["activeTargets"]} == {"up"}, UP_S,
             lambda: f"every target up: {prom.api('targets')['activeTargets']}")
        m, b = mps.client, blink.client
        m.load(program_body(str(EXAMPLES / "heartbeat")))
        m.load(program_body(str(EXAMPLES / "echo")))  # the pool's last worker a load may take: none idle now
        b.load(program_body(str(EXAMPLES / "heartbeat")))
        b.load(program_body(str(EXAMPLES / "echo")))  # a blink: heartbeat halted and relaunched
        b.load(program_body(str(EXAMPLES / "spin"), restart="always"))  # it returns at once, again and again
        for c in (m, b):
            for _ in range(20):
                assert c.call("echo", "ping")["data"] == "ping"
        for _ in range(5):  # calls that fail: heartbeat does not serve its ring
            with pytest.raises(ClientError):
                m.call("heartbeat", "anyone?")

        hb = m.program("heartbeat")["pid"]
        os.kill(hb, signal.SIGSTOP)  # its kernel beats no more: stalled after --stall-after
        try:
            poll(lambda: "MeshdMpsProgramStalled" in prom.firing(), UP_S, lambda: f"a stall fired: {prom.firing()}")
        finally:
            os.kill(hb, signal.SIGCONT)
        m.load(program_body(str(EXAMPLES / "fault"), restart="never"))  # a GPU fault, the others relaunched
        alerts = {r["alert"] for g in yaml.safe_load(ALERTS.read_text())["groups"] for r in g["rules"]}
        # (the pool's alert ends with the fault: its recovery refills the pool to its cap)
        poll(lambda: prom.firing() is not None and alerts <= prom.fired, UP_S,
             lambda: f"every alert fired; not yet: {alerts - prom.fired}")
        stalled = [a for a in prom.api("alerts")["alerts"] if a["labels"]["alertname"] == "MeshdMpsProgramStalled"]
        assert all(a["labels"]["program"] == "heartbeat" for a in stalled), stalled

        for c in (m, b):  # calls in the last minute's window, for the latency panels (their rates over it)
            for _ in range(5):
                c.call("echo", "pong")

        def scraped() -> bool:
            ok = prom.query('sum(meshd_mps_program_calls_total{program="echo",outcome="ok"})')
            return bool(ok and float(ok[0]["value"][1]) == 50 and prom.query("meshd_mps_gpu_faults_total > 0")
                        and prom.query("meshd_mps_blinks_total > 0"))

        poll(scraped, UP_S, "the last calls, the GPU fault and the blinks scraped")
        empty = []
        for p in panels(json.loads(DASHBOARD.read_text())):
            values = []
            for t in p["targets"]:
                got = prom.query(expr_of(t))
                if not got:
                    empty.append(f"{p['title']}: {t['expr']}")
                values += [float(r["value"][1]) for r in got]
            if not any(math.isfinite(v) for v in values):
                empty.append(f"{p['title']}: no finite value {values}")
        assert not empty, "panels without data:\n" + "\n".join(empty)
    finally:
        prom.stop()
        fleet.shutdown()
        fleet.server_close()
