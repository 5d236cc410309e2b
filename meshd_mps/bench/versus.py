"""Row (v) versus: examples/knn's exact top-k (k = 10) over a table of N vectors of 128 fp16 numbers
(N = 1,000,000; 100,000 with --quick), batches of 1, 8 and 64 queries, resident in meshd-mps beside
what a user runs instead, the same table and queries for every contender; then the same with fp32
numbers (meshd-mps in MPS mode, in-process, beside the same contenders):

- meshd-mps resident, both isolation modes: ``Programs.call`` in this process, and through a
  daemon's socket as a client process calls it (``Client.call_bytes``, the CLI's HTTP client);
- PyTorch eager and a CUDA graph, and the same search launched once per batch (``knn_once``): in a
  process of their own (``bench/contenders.py``), on the GPU only, each "skipped" with its reason
  where it cannot run (no torch, the simulated GPU).

Per contender and batch: p50 and p99 (``reps`` batches after a warm-up), batches a second with 8 in
flight (meshd-mps's), and the scan's bandwidth (the table's bytes over the p50) against the device's
copy bandwidth measured in the same run.  Every contender's answer to the same check queries equals
numpy's exact one (ties at the k-th score aside, which topk orders as it likes).  Also shown: where a
resident call's time goes (knn's own times of its steps on the GPU, asked for by its request's flag,
the rest the host's and the bus's); a resident heartbeat's largest gap while knn answers at full
rate, against its idle one; and what a resident knn costs while nothing asks it (the GPU's power and
SM activity from NVML, against the same backend with nothing loaded).  The table's numbers are whole
(-8..8), so that every contender's sums are exact and the answers comparable.
"""

from __future__ import annotations

import asyncio
import functools
import importlib.util
import json
import os
import subprocess
import sys
import time
from types import ModuleType
from typing import Any

import anyio
import numpy as np

from meshd_mps.bench.measure import beat, pct, until
from meshd_mps.bench.report import Row, quantiles
from meshd_mps.bench.restart import _Serve
from meshd_mps.bench.rig import EXAMPLES, Bench
from meshd_mps.gpu.nvml import Activity, Nvml
from meshd_mps.programs import Programs
from meshd_mps.protocol import abi

K, DIM, BATCHES = 10, 128, (1, 8, 64)
#: The window NVML's power and SM activity are read over (s): its energy counter moves in steps.
IDLE_S = 2.0
#: Calls a batch that ask for knn's times of its steps (the medians are shown).
SPLIT = 200
#: Blocks of knn a launch: two an SM (as many as its registers and shared memory let be resident), on
#: every SM but one, which is left for the heartbeat beside it.
NODES_PER_SM = 2


def nodes_for(sms: int) -> int:
    return NODES_PER_SM * (sms - 1)


def _example(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"knn_{name}", EXAMPLES / "knn" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    sys.path.insert(0, str(EXAMPLES / "knn"))  # make_table imports its sibling knn_client
    try:
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
    finally:
        sys.path.remove(str(EXAMPLES / "knn"))
    return mod


def same(a_ids: np.ndarray, a_scores: np.ndarray, b_ids: np.ndarray, b_scores: np.ndarray) -> bool:
    """Two answers are the same: equal scores, rank by rank, and the same rows at every rank whose
    score is above the k-th (rows tied with the k-th may be any of the tied ones)."""
    if a_scores.shape != b_scores.shape or not np.array_equal(a_scores, b_scores):
        return False
    for i in range(a_ids.shape[0]):
        above = a_scores[i] > a_scores[i, -1]
        if set(a_ids[i][above].tolist()) != set(b_ids[i][above].tolist()):
            return False
    return True


def activity(seconds: float) -> Activity | str:
    """GPU 0's power and SM activity over ``seconds`` (NVML), or why it cannot be read here."""
    try:
        with Nvml.open() as nvml:
            return nvml.activity(0, seconds)
    except Exception as e:  # NvmlUnavailable (the simulated GPU, no driver), DeviceError: said, not raised
        return f"{type(e).__name__}: {e}"


async def resident(bench: Bench, mode: str, path: str, qs: np.ndarray, check: np.ndarray,
                   reps: int, power: bool = False) -> dict[str, Any]:
    """knn resident, called in this process: ``lat`` (latencies by batch), ``rate`` (batches a second
    with 8 in flight, by batch), ``got`` (its answer to ``check``), ``gaps`` ((heartbeat's gap at full
    rate, idle) us), ``split`` (by batch: the call's p50 and each of knn's steps' median, us); with
    ``power``, ``activity`` (the GPU's, with nothing loaded and with knn resident and idle)."""
    kc = _example("knn_client")
    async with await bench.backend(mode, pool=3 if mode == "mps" else 0) as b:
        ps = Programs(b)
        try:
            before = await anyio.to_thread.run_sync(activity, IDLE_S) if power else None
            assert b.info is not None
            await ps.load(*await bench.src(b, "knn"), nodes=nodes_for(b.info.sms_total), data=path)
            await ps.call("knn", kc.request(check[:1], K), timeout=60)  # serving: its first request answered
            loaded = await anyio.to_thread.run_sync(activity, IDLE_S) if power else None
            hb = await ps.load(*await bench.src(b, "heartbeat"))
            await until(lambda: b.mailbox.heartbeat(hb.slot) > 0, 10, "the heartbeat's first beat")
            lat: dict[int, list[float]] = {}
            rate: dict[int, float] = {}
            split: dict[int, dict[str, float]] = {}
            for nq in BATCHES:
                req = kc.request(qs[:nq], K)
                for _ in range(bench.n(5, 1)):
                    await ps.call("knn", req, timeout=60)
                xs = []
                for _ in range(reps):
                    t0 = time.perf_counter()
                    await ps.call("knn", req, timeout=60)
                    xs.append(time.perf_counter() - t0)
                lat[nq] = xs
                split[nq] = await steps(ps, kc.request(qs[:nq], K, times=True), bench.n(SPLIT, 3), kc)
                await beat(b, hb.slot, reset=True)
                t0 = time.perf_counter()
                await ps.call_many("knn", [req] * reps, timeout=60, window=8)
                rate[nq] = reps / (time.perf_counter() - t0)
                busy = float(b.mailbox.u64(hb.slot, abi.MAX_GAP))
            await beat(b, hb.slot, reset=True)
            await asyncio.sleep(0.2)
            await beat(b, hb.slot)
            idle = float(b.mailbox.u64(hb.slot, abi.MAX_GAP))
            got = kc.answer(await ps.call("knn", kc.request(check, K), timeout=60))
            return {"lat": lat, "rate": rate, "got": got, "gaps": (busy / 1e3, idle / 1e3), "split": split,
                    "activity": (before, loaded)}
        finally:
            await ps.close()


async def steps(ps: Programs, req: bytes, n: int, kc: ModuleType) -> dict[str, float]:
    """Where ``n`` calls of ``req`` (which asks for knn's times) spent their time, medians in us: the
    call (``call``), knn's steps on the GPU (``read``, ``scan``, ``merge``, ``write``), and the rest
    (``host``: the request written, its entry and REQ_HEAD crossing the bus, the response's polled
    and read)."""
    rows: list[tuple[float, ...]] = []
    for _ in range(n):
        t0 = time.perf_counter()
        got = kc.answer(await ps.call("knn", req, timeout=60))
        took = time.perf_counter() - t0
        t = got.times
        assert t is not None
        rows.append((took * 1e6, t.read / 1e3, t.scan / 1e3, t.merge / 1e3, t.write / 1e3,
                     took * 1e6 - sum(t) / 1e3))
    cols = list(zip(*rows, strict=True))
    return {k: float(np.median(v)) for k, v in zip(("call", "read", "scan", "merge", "write", "host"), cols, strict=True)}


def through_socket(bench: Bench, mode: str, path: str, qs: np.ndarray, reps: int) -> dict[int, list[float]]:
    """knn behind a ``meshd-mps serve`` of its own, called through its socket by the CLI's client
    (blocking, as a client process is: run in a thread)."""
    from meshd_mps.serving.client import Client

    kc = _example("knn_client")
    d = os.path.join(bench.base, f"versus-{mode}")
    os.makedirs(d, exist_ok=True)
    s = _Serve(d, bench, "--devices", "0", isolation=mode)
    try:
        s.start()
        c = Client(s.sock, timeout=120)
        nodes = nodes_for(int(c.status()["caps"]["sms_total"]))
        c.load(c.with_data(c.program_body(str(EXAMPLES / "knn"), nodes=nodes, loading=True), path))
        out: dict[int, list[float]] = {}
        for nq in BATCHES:
            req = kc.request(qs[:nq], K)
            for _ in range(bench.n(5, 1)):
                c.call_bytes("knn", req, timeout=60)
            xs = []
            for _ in range(reps):
                t0 = time.perf_counter()
                c.call_bytes("knn", req, timeout=60)
                xs.append(time.perf_counter() - t0)
            out[nq] = xs
        return out
    finally:
        s.stop()


def contenders(bench: Bench, x_path: str, qs_path: str, check_path: str, reps: int) -> dict[str, Any]:
    """PyTorch eager, its CUDA graph and knn launched once a batch, in a process of their own."""
    if bench.gpu != "cuda":
        return {"torch": {"skipped": "the simulated GPU: no GPU to run them on"},
                "once": {"skipped": "the simulated GPU: no GPU to run them on"}}
    manifest = json.loads((EXAMPLES / "knn" / "manifest.json").read_text())
    spec = {"table": x_path, "queries": qs_path, "check": check_path, "batches": list(BATCHES), "k": K, "reps": reps,
            "warm": 20, "source": str(EXAMPLES / "knn" / "knn.cu"), "include": str(EXAMPLES / "include"),
            "smem": manifest["smem"], "scratch": manifest["scratch"], "nodes_per_sm": NODES_PER_SM}
    spec_path = os.path.join(bench.base, "versus-spec.json")
    with open(spec_path, "w") as f:
        json.dump(spec, f)
    r = subprocess.run([sys.executable, "-m", "meshd_mps.bench.contenders", spec_path], capture_output=True, text=True,
                       timeout=600)
    if r.returncode != 0:
        why = (r.stderr.strip().splitlines() or [f"exit status {r.returncode}"])[-1]
        return {"torch": {"skipped": f"the contenders' process failed: {why}"}, "once": {"skipped": why}}
    out: dict[str, Any] = json.loads(r.stdout)
    return out


def _contender_base(other: dict[str, Any]) -> tuple[dict[str, dict[int, list[float]]], dict[str, str]]:
    """The contenders' latencies by name and batch, and why each one skipped did."""
    skipped = {k: v["skipped"] for k, v in other.items() if "skipped" in v}
    base: dict[str, dict[int, list[float]]] = {}
    if "torch" not in skipped:
        base["PyTorch eager"] = {int(k): v for k, v in other["torch"]["eager"].items()}
        base["CUDA graph"] = {int(k): v for k, v in other["torch"]["graph"].items()}
    if "once" not in skipped:
        base["a launch per batch"] = {int(k): v for k, v in other["once"]["once"].items()}
    return base, skipped


def _answers(other: dict[str, Any], skipped: dict[str, str], want: Any, what: str) -> list[Row]:
    rows = []
    for who in ("torch", "once"):
        if who not in skipped:
            a = other[who]["answer"]
            ok = same(np.array(a["ids"]), np.array(a["scores"], np.float32), want.ids, want.scores)
            rows.append(Row("v", f"versus{what}: {'PyTorch' if who == 'torch' else 'a launch per batch'}'s answer is"
                                 " numpy's", target="equal", ok=ok, note=f"{len(want.ids)} queries, k {K}"))
    return rows


def _split_row(mode: str, nq: int, sp: dict[str, float], what: str = "") -> Row:
    gpu = sp["read"] + sp["scan"] + sp["merge"] + sp["write"]
    return Row("v", f"versus{what}: where a resident call's time goes ({mode}), batch {nq}", "us", sp["call"],
               note=(f"medians of calls that ask knn for its steps' times: on the GPU {gpu:.1f} us (the request read"
                     f" {sp['read']:.1f}, the scan {sp['scan']:.1f}, the merge of the blocks' bests {sp['merge']:.1f},"
                     f" the response written {sp['write']:.1f}); the host and the bus {sp['host']:.1f} (the request"
                     " written, its entry read by the GPU, the response polled and read)"),
               parts={k: sp[k] for k in ("host", "read", "scan", "merge", "write")})


def _idle_rows(mode: str, act: tuple[Activity | str | None, Activity | str | None]) -> list[Row]:
    before, loaded = act
    if not isinstance(before, Activity) or not isinstance(loaded, Activity):
        why = next(a for a in act if not isinstance(a, Activity))
        return [Row("v", f"versus: an idle resident knn's cost ({mode})", note=f"skipped: {why}")]

    def percent(v: float | None) -> str:
        return "-" if v is None else f"{v:.1f} %"

    def said(a: Activity) -> str:
        return (f"GPU utilization {percent(a.gpu_util)}, SM active {percent(a.sm_active)}, SM occupancy"
                f" {percent(a.sm_occupancy)}"
                + (f" ({a.why})" if a.why else ""))

    note = (f"NVML over {loaded.seconds:.1f} s each: knn resident and idle (no request): {said(loaded)}; nothing"
            f" loaded: {said(before)}")
    return [Row("v", f"versus: an idle resident knn's power ({mode})", "W", loaded.watts, before.watts,
                "the same backend, nothing loaded", note=note)]


def _numpys(what: str, mode: str, got: Any, want: Any) -> Row:
    """meshd-mps's answer against numpy's."""
    return Row("v", f"versus{what}: meshd-mps ({mode})'s answer is numpy's", target="equal",
               ok=same(got.ids, got.scores, want.ids, want.scores), note=f"{len(want.ids)} queries, k {K}")


def _resident_p50(what: str, mode: str, nq: int, lat: list[float], eager: dict[int, list[float]] | None, gpu: bool,
                  note0: str, table_bytes: int, extra: str = "", why: str = "") -> Row:
    """A resident batch's p50 against PyTorch eager's (the target at batch 1, on the GPU); ``extra``
    joins its note after the p99, ``why`` says why eager is missing."""
    p50 = pct(lat, 0.5)
    r = Row("v", f"versus{what}: meshd-mps resident ({mode}, in-process), batch {nq}, p50", "us", p50 * 1e6,
            pct(eager[nq], 0.5) * 1e6 if eager else None, "PyTorch eager p50" if eager else "",
            note=(f"{note0}; p99 {pct(lat, 0.99) * 1e6:.0f} us{extra}; the scan {table_bytes / p50 / 1e9:.0f} GB/s at the"
                  " p50" + (f"; {why}" if not eager else "")),
            dist={"meshd-mps": quantiles(lat)})
    if nq == 1 and eager and gpu:
        r.target, r.ok = "<= 0.5x eager", p50 <= 0.5 * pct(eager[nq], 0.5)
    return r


def _contender_row(what: str, who: str, nq: int, by: dict[int, list[float]], note0: str) -> Row:
    return Row("v", f"versus{what}: {who}, batch {nq}, p50", "us", pct(by[nq], 0.5) * 1e6, None,
               note=f"{note0}; p99 {pct(by[nq], 0.99) * 1e6:.0f} us", dist={who: quantiles(by[nq])})


async def sec_versus(bench: Bench) -> list[Row]:
    rows: list[Row] = []
    n, reps = bench.n(1_000_000, 100_000), bench.n(1000, 3)
    gpu = bench.gpu == "cuda"  # the targets are the GPU's: the simulated GPU's figures only show the path runs
    make_table, kc = _example("make_table"), _example("knn_client")
    rng = np.random.default_rng(12)
    qs = rng.integers(-8, 9, size=(max(BATCHES), DIM)).astype(np.float32)
    check = qs[:4]
    d = os.path.join(bench.base, "versus")
    os.makedirs(d, exist_ok=True)
    for name, arr in (("qs", qs), ("check", check)):
        np.save(os.path.join(d, f"{name}.npy"), arr)
    qs_path, check_path = (os.path.join(d, f"{name}.npy") for name in ("qs", "check"))

    def table(dtype: str) -> tuple[np.ndarray, str, str]:
        x = make_table.table(n, DIM, dtype, seed=11, integers=True)
        path, x_path = os.path.join(d, f"table-{dtype}.bin"), os.path.join(d, f"x-{dtype}.npy")
        make_table.write(path, x)
        np.save(x_path, x)
        return x, path, x_path

    x, path, x_path = table("f16")
    want = kc.search(x, check, K)
    table_bytes = x.nbytes
    other = await anyio.to_thread.run_sync(functools.partial(contenders, bench, x_path, qs_path, check_path, reps))
    copy_gbs = other.get("torch", {}).get("copy_gbs")
    base, skipped = _contender_base(other)
    rows += _answers(other, skipped, want, "")
    eager = base.get("PyTorch eager")
    graph = base.get("CUDA graph")
    note0 = f"N {n}, D {DIM} fp16, k {K}; {reps} batches after a warm-up"
    for mode in ("blink", "mps"):
        r0 = await resident(bench, mode, path, qs, check, reps, power=True)
        lat, rate, got, (busy, idle) = r0["lat"], r0["rate"], r0["got"], r0["gaps"]
        rows.append(_numpys("", mode, got, want))
        # --quick: through one daemon's socket (MPS mode's), the client's path being the same in both
        sock = None if bench.quick and mode == "blink" else await anyio.to_thread.run_sync(
            functools.partial(through_socket, bench, mode, path, qs, reps))
        for nq in BATCHES:
            p50, p99 = pct(lat[nq], 0.5), pct(lat[nq], 0.99)
            rows.append(_resident_p50("", mode, nq, lat[nq], eager, gpu, note0, table_bytes,
                                      f"; {rate[nq] * nq:.0f} queries/s with 8 in flight", skipped.get("torch", "")))
            if nq == 1 and graph:
                rows.append(Row("v", f"versus: meshd-mps resident ({mode}, in-process), batch 1, p50 against the graph", "us",
                                p50 * 1e6, pct(graph[1], 0.5) * 1e6, "CUDA graph p50", "<= 0.8x graph",
                                p50 <= 0.8 * pct(graph[1], 0.5)))
            rows.append(Row("v", f"versus: meshd-mps resident ({mode}, in-process), batch {nq}, p99", "us", p99 * 1e6,
                            p50 * 1e6, "its own p50", "<= 2x" if gpu else "-", p99 <= 2 * p50 if gpu else None))
            if nq == 64:
                gbs = table_bytes / p50 / 1e9
                rows.append(Row("v", f"versus: the scan's bandwidth ({mode}), batch 64", "GB/s", gbs, copy_gbs,
                                "device copy (read + write)" if copy_gbs else "", ">= 0.7x copy" if copy_gbs else "-",
                                gbs >= 0.7 * copy_gbs if copy_gbs else None, "the table's bytes over the call's p50"))
            rows.append(_split_row(mode, nq, r0["split"][nq]))
            if sock is None:
                continue
            s50 = pct(sock[nq], 0.5)
            rows.append(Row("v", f"versus: meshd-mps resident ({mode}, through its socket), batch {nq}, p50", "us",
                            s50 * 1e6, p50 * 1e6, "in-process p50", note=f"p99 {pct(sock[nq], 0.99) * 1e6:.0f} us"))
        rows.append(Row("v", f"versus: a resident heartbeat's largest gap while knn answers at full rate ({mode})", "us",
                        busy, idle, "idle gap", note="the batches of 64, 8 in flight"))
        rows += _idle_rows(mode, r0["activity"])
    rows += [_contender_row("", who, nq, by, note0) for who, by in base.items() for nq in BATCHES]
    for who, why in skipped.items():
        rows.append(Row("v", f"versus: {'PyTorch eager and its CUDA graph' if who == 'torch' else 'a launch per batch'}",
                        note=f"skipped: {why}"))
    rows += await _fp32(bench, table, qs, qs_path, check, check_path, reps, gpu)
    return rows


async def _fp32(bench: Bench, table: Any, qs: np.ndarray, qs_path: str, check: np.ndarray, check_path: str,
                reps: int, gpu: bool) -> list[Row]:
    """The same search over fp32 numbers (twice the table's bytes): meshd-mps in MPS mode, in-process,
    beside the same contenders (PyTorch's matmul in fp32, as torch does by default)."""
    kc = _example("knn_client")
    x, path, x_path = table("f32")
    want = kc.search(x, check, K)
    other = await anyio.to_thread.run_sync(functools.partial(contenders, bench, x_path, qs_path, check_path, reps))
    base, skipped = _contender_base(other)
    rows = _answers(other, skipped, want, " fp32")
    r0 = await resident(bench, "mps", path, qs, check, reps)
    rows.append(_numpys(" fp32", "mps", r0["got"], want))
    eager = base.get("PyTorch eager")
    note0 = f"N {x.shape[0]}, D {DIM} fp32, k {K}; {reps} batches after a warm-up"
    for nq in BATCHES:
        rows.append(_resident_p50(" fp32", "mps", nq, r0["lat"][nq], eager, gpu, note0, x.nbytes,
                                  why=skipped.get("torch", "")))
        rows.append(_split_row("mps", nq, r0["split"][nq], " fp32"))
        rows += [_contender_row(" fp32", who, nq, by, note0) for who, by in base.items()]
    return rows
