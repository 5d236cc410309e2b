"""The daemon's Prometheus metrics, exposed with prometheus_client.

Most metrics are read from the live objects when scraped, never kept twice: one collector
(:class:`Live`) walks a table of families (name, type, help, labels, a reader) and asks the
Backend and Programs for each value.  What only the daemon sees is kept here: the load-time
histogram (a prometheus_client ``Histogram``), the answers by status code, and the faults and
worker deaths counted by :meth:`Metrics.scan`.  Each daemon has its own ``CollectorRegistry``
(never the process-global one), so that two daemons in one process, or tests, do not share them.
"""

from __future__ import annotations

import time
import traceback
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import structlog
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from meshd_mps.base.callstats import BUCKETS

if TYPE_CHECKING:
    from meshd_mps.backend import Backend
    from meshd_mps.neighbours import NeighbourWatch
    from meshd_mps.programs import Program, Programs

log = structlog.get_logger("meshd_mps")

#: What GET /metrics answers with.
CONTENT_TYPE = CONTENT_TYPE_LATEST
#: The load-time histogram's buckets (seconds): a cached load is milliseconds, a JIT and an MPS
#: worker's first context seconds.
LOAD_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
#: Program states the metrics always list (each 0 when no program is in it).
STATES = ("running", "stalled", "exited", "failed", "faulted", "restarting", "crash-loop")

Labels = Mapping[str, str]
#: A histogram's sample: its count per bucket of ``BUCKETS`` (the last: past every bound), and their sum.
Buckets = tuple[Sequence[int], float]
#: What a reader returns: one value (None: no sample), (labels, value) pairs, or for a histogram
#: (labels, Buckets) pairs.
Read = float | int | None | Iterable[tuple[Labels, float]] | Iterable[tuple[Labels, Buckets]]


@dataclass(frozen=True)
class Family:
    """One metric family and the function that reads its samples from the live objects."""

    name: str
    kind: str  # "counter" | "gauge" | "histogram" (its buckets are the calls' BUCKETS)
    help: str
    read: Callable[[], Read]
    labels: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.kind == "counter" and not self.name.endswith("_total"):
            raise ValueError(f"metrics: counter {self.name} must end in _total")  # its sample's name is its own

    def collect(self) -> Metric:
        if self.kind == "histogram":
            return self._histogram()
        make = CounterMetricFamily if self.kind == "counter" else GaugeMetricFamily
        got = self.read()
        if not self.labels:
            assert got is None or isinstance(got, (int, float)), f"{self.name}: one value expected"
            return make(self.name, self.help) if got is None else make(self.name, self.help, value=got)
        assert got is not None and not isinstance(got, (int, float)), f"{self.name}: samples with labels expected"
        m = make(self.name, self.help, labels=self.labels)
        for labels, value in got:
            m.add_metric([labels[k] for k in self.labels], value)  # type: ignore[arg-type]
        return m

    def _histogram(self) -> Metric:
        m = HistogramMetricFamily(self.name, self.help, labels=self.labels)
        for labels, (counts, total) in self.read():  # type: ignore[union-attr, misc]
            cumulative, acc = [], 0
            for le, c in zip((*map(floatToGoString, BUCKETS), "+Inf"), counts, strict=True):
                acc += c
                cumulative.append((le, float(acc)))
            m.add_metric([labels[k] for k in self.labels], cumulative, total)
        return m


class Live(Collector):
    """The families read when scraped; one that fails is left out (and logged), never the others."""

    def __init__(self, families: list[Family]):
        self.families = families

    def collect(self) -> Iterator[Metric]:
        for f in self.families:
            try:
                m = f.collect()
            except Exception:
                log.error(f"metrics: {f.name}: collector failed", metric=f.name, traceback=traceback.format_exc())
                continue
            yield m


def new_registry() -> CollectorRegistry:
    """A registry of one's own, never the process-global one.  Without ``_created`` series: the
    classic text format has no such thing (prometheus_client would add one to every histogram as
    a gauge of its own), and the exposition keeps the names it always had.  That switch is
    prometheus_client's, for the whole process."""
    disable_created_metrics()
    return CollectorRegistry(auto_describe=False)


class Metrics:
    """One daemon's registry over its Backend and Programs."""

    def __init__(self, backend: Backend, programs: Programs, version: str, t0: float):
        self.b, self.ps, self.version, self.t0 = backend, programs, version, t0
        #: The daemon's NVML watch (None until NVML answered, or without NVML): neighbours.py.
        self.watch: NeighbourWatch | None = None
        self.registry = new_registry()
        self.load_seconds = Histogram(
            "meshd_mps_load_seconds", "Time of each successful load or upgrade (checks, JIT or cache, preload, launch).",
            buckets=LOAD_BUCKETS, registry=self.registry)
        self.registry.register(Live(self.families()))
        self.http_codes: dict[int, int] = {}

    def answered(self, status: int) -> None:
        """Counts one answer of the control API."""
        self.http_codes[status] = self.http_codes.get(status, 0) + 1

    def loaded(self) -> None:
        """After a successful load or upgrade: its time into the histogram."""
        if self.ps.load_ms:
            self.load_seconds.observe(self.ps.load_ms[-1] / 1e3)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)

    def _foreign(self) -> list[tuple[Labels, float]]:
        """Each GPU NVML was read for (none without NVML): its foreign processes."""
        latest = self.watch.latest if self.watch is not None else {}
        return [({"device": str(d)}, float(len(n.foreign))) for d, n in sorted(latest.items())]

    def _memory(self, i: int) -> list[tuple[Labels, float]]:
        """Each GPU's memory used (``i`` 0) or in all (1), from NVML's last look."""
        latest = self.watch.latest if self.watch is not None else {}
        return [({"device": str(d)}, float(n.memory[i])) for d, n in sorted(latest.items()) if n.memory is not None]

    def _program_families(self) -> list[Family]:
        """Per program: its state, faults and restarts, its calls (outcomes, latency, bytes) and
        its data, each labelled ``program``."""
        ps = self.ps

        def each(value: Callable[[Program], float]) -> Callable[[], list[tuple[Labels, float]]]:
            return lambda: [({"program": p.name}, float(value(p))) for p in ps.by_name.values()]

        def outcomes() -> list[tuple[Labels, float]]:
            return [({"program": p.name, "outcome": k}, float(v)) for p in ps.by_name.values()
                    for k, v in p.calls.outcomes.items()]

        def latency() -> list[tuple[Labels, Buckets]]:
            return [({"program": p.name}, (p.calls.counts, p.calls.seconds)) for p in ps.by_name.values()]

        return [
            Family("meshd_mps_program_state", "gauge", "Each program's state (always 1, in the label state).",
                   lambda: [({"program": p.name, "state": ps.describe(p)["state"]}, 1.0) for p in ps.by_name.values()],
                   ("program", "state")),
            Family("meshd_mps_program_faults_total", "counter",
                   "Each program's launches that failed (its own error, a GPU fault, its worker's death).",
                   each(lambda p: p.faults), ("program",)),
            Family("meshd_mps_program_restarts", "gauge", "Each program's relaunches since its last load or upgrade.",
                   each(lambda p: p.restarts), ("program",)),
            Family("meshd_mps_program_calls_total", "counter", "Calls through each program's ring, by outcome (ok,"
                   " timeout, not_running, not_serving, ring_full, too_large, cancelled, error).", outcomes,
                   ("program", "outcome")),
            Family("meshd_mps_program_call_seconds", "histogram",
                   "Each answered call's time, from the call to its response (a pipelined batch: its time over its"
                   " requests).", latency, ("program",)),
            Family("meshd_mps_program_bytes_in_total", "counter", "Request bytes sent into each program's ring.",
                   each(lambda p: p.calls.bytes_in), ("program",)),
            Family("meshd_mps_program_bytes_out_total", "counter", "Response bytes read from each program's ring.",
                   each(lambda p: p.calls.bytes_out), ("program",)),
        ]

    def families(self) -> list[Family]:
        b, ps = self.b, self.ps
        assert b.caps is not None
        caps = b.caps

        def by_state() -> list[tuple[Labels, float]]:
            n = dict.fromkeys(STATES, 0)
            for p in ps.by_name.values():
                st = ps.describe(p)["state"]  # "stalled" included (its heartbeat stopped)
                n[st] = n.get(st, 0) + 1
            return [({"state": k}, v) for k, v in n.items()]

        def beat_ages() -> list[tuple[Labels, float]]:
            ages = [(p.name, ps.describe(p).get("beat_age_s")) for p in ps.by_name.values()]
            return [({"program": name}, age) for name, age in ages if age is not None]  # never beat: no sample

        def by_device(value: Callable[[int], float]) -> Callable[[], list[tuple[Labels, float]]]:
            return lambda: [({"device": str(d)}, value(d)) for d in b.devices]

        out = [
            Family("meshd_mps_info", "gauge", "This daemon: version, isolation mode, GPU kind and device (always 1).",
                   lambda: [({"version": self.version, "isolation": b.isolation, "gpu": b.gpu, "device": caps.name}, 1)],
                   ("version", "isolation", "gpu", "device")),
            Family("meshd_mps_uptime_seconds", "gauge", "Seconds since the daemon started.",
                   lambda: round(time.monotonic() - self.t0, 3)),
            Family("meshd_mps_loads_total", "counter", "Successful loads and upgrades.", lambda: ps.loads),
            Family("meshd_mps_programs", "gauge", "Loaded programs, by state.", by_state, ("state",)),
            Family("meshd_mps_faults_total", "counter",
                   "Programs' launches that failed (a launch error, a GPU fault, a worker death).", lambda: ps.failed_total),
            Family("meshd_mps_program_restarts_total", "counter",
                   "Programs relaunched by themselves: after a fault, or by their restart policy.", lambda: ps.relaunched_total),
            Family("meshd_mps_gpu_faults_total", "counter",
                   "GPU faults that took every program of a GPU down (MPS: every client; blink: the context), each recovered.",
                   lambda: sum(1 for f in getattr(ps, "faults", []) if getattr(f, "gpu_wide", False))),
            Family("meshd_mps_worker_deaths_total", "counter", "Programs that ended because their worker process died.",
                   lambda: ps.deaths_total),
            Family("meshd_mps_recovery_step_seconds", "gauge",
                   "The latest GPU fault's recovery, by step (decide, teardown, server_ready, contexts, relaunch).",
                   lambda: [({"step": k}, v / 1e3) for k, v in next((f.steps for f in reversed(ps.faults) if f.gpu_wide),
                                                                      {}).items()], ("step",)),
            Family("meshd_mps_workers", "gauge", "Live worker processes (MPS clients, or the blink context).",
                   lambda: len(b.sup.live())),
            Family("meshd_mps_workers_retired_total", "counter",
                   "Worker processes retired and reaped (pool overflow, unfit, dead).", lambda: b.sup.retired),
            Family("meshd_mps_pool_idle", "gauge", "Idle pooled workers, every GPU's (MPS mode).",
                   lambda: sum(g.pooled()[0] for g in b.isolations.values())),
            Family("meshd_mps_pool_capacity", "gauge", "The pools' capacity: --pool per GPU.",
                   lambda: sum(g.pooled()[1] for g in b.isolations.values())),
            Family("meshd_mps_pool_reserve", "gauge",
                   "Idle pooled workers that no load takes, kept for upgrades, every GPU's (MPS mode).",
                   lambda: sum(g.reserve()[0] for g in b.isolations.values())),
            Family("meshd_mps_pool_reserve_capacity", "gauge", "The pools' reserve: the last worker of each pool.",
                   lambda: sum(g.reserve()[1] for g in b.isolations.values())),
            Family("meshd_mps_clients_created_total", "counter",
                   "MPS clients our workers created; each stalls the running programs of its GPU once (MPS mode).",
                   lambda: b.mps.created if b.mps is not None else 0),
            Family("meshd_mps_device_info", "gauge", "Each GPU served, by CUDA ordinal and name (always 1).",
                   lambda: [({"device": str(d), "name": b.device_caps[d].name}, 1) for d in b.devices], ("device", "name")),
            Family("meshd_mps_device_programs", "gauge", "Loaded programs on each GPU.",
                   by_device(lambda d: len(ps.on_device(d))), ("device",)),
            Family("meshd_mps_device_pool_idle", "gauge", "Idle pooled workers on each GPU (MPS mode).",
                   by_device(lambda d: b.isolations[d].pooled()[0]), ("device",)),
            Family("meshd_mps_device_sm_share", "gauge",
                   "The part of each GPU's resident blocks its running programs hold (0-1): what is left to place there.",
                   by_device(ps.sm_share), ("device",)),
            Family("meshd_mps_device_memory_used_bytes", "gauge", "Each GPU's memory in use, per NVML (the simulation's"
                   " figures with --gpu sim; no sample before NVML's first look).", lambda: self._memory(0), ("device",)),
            Family("meshd_mps_device_memory_total_bytes", "gauge", "Each GPU's memory, per NVML.",
                   lambda: self._memory(1), ("device",)),
            Family("meshd_mps_device_foreign_processes", "gauge",
                   "Processes with a context on each GPU outside our MPS server (blink: beside our context), per NVML.",
                   self._foreign, ("device",)),
        ]
        if b.blink_stats():  # the GPUs' module changes halt their programs (blink mode)
            def last_blink() -> float | None:
                ms = b.last_blink_ms()
                return None if ms is None else ms / 1e3

            out += [
                Family("meshd_mps_blinks_total", "counter",
                       "Blinks: module changes that halted and relaunched running programs.",
                       lambda: sum(s.count for s in b.blink_stats().values())),
                Family("meshd_mps_device_blinks_total", "counter", "Blinks on each GPU (each GPU's context blinks alone).",
                       lambda: [({"device": str(d)}, s.count) for d, s in b.blink_stats().items()], ("device",)),
                Family("meshd_mps_last_blink_seconds", "gauge",
                       "Length of the last blink on any GPU (absent before the first).", last_blink),
            ]
        out += [
            Family("meshd_mps_program_heartbeat", "gauge",
                   "Each program's heartbeat counter (its mailbox slot's HEARTBEAT word).",
                   lambda: [({"program": p.name}, b.mailbox.heartbeat(p.slot)) for p in ps.by_name.values()],
                   ("program",)),
            Family("meshd_mps_program_data_bytes", "gauge",
                   "Each program's data: the device memory it owns (docs/program-abi.md, \"Data\"); 0 without.",
                   lambda: [({"program": p.name}, p.data_bytes) for p in ps.by_name.values()],
                   ("program",)),
            Family("meshd_mps_program_beat_age_seconds", "gauge",
                   "Seconds since each program's heartbeat was last seen advancing (no sample for one that never beat).",
                   beat_ages, ("program",)),
            *self._program_families(),
            Family("meshd_mps_sms", "gauge", "SMs a program may use (--sms, else the device's).", lambda: caps.sms),
            Family("meshd_mps_http_requests_total", "counter", "Control API requests answered, by status code.",
                   lambda: [({"code": str(k)}, v) for k, v in sorted(self.http_codes.items())], ("code",)),
        ]
        return out
