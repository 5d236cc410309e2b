"""A program's end, watched, and what follows it: its own failure reported, a fault of its GPU
recovered (every program of that GPU torn down, the culprit named, the others relaunched), and
its restart policy carried out (a relaunch after its backoff, or a crash loop declared).

Every change of a program's state here goes through ``Program.to``; a task that waits (a watcher,
a relaunch after a backoff) holds the generation it was started for and does nothing once the
program is another generation or gone (``Registry.current``).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import anyio
import structlog

from meshd_mps.base import faults, restart
from meshd_mps.base.errors import MeshError, WorkerError
from meshd_mps.isolation import limits
from meshd_mps.programs.program import LIVE, ProgramState, Run
from meshd_mps.programs.report import FaultReport
from meshd_mps.protocol import abi, frames

if TYPE_CHECKING:
    from meshd_mps.backend import Image, Kernel
    from meshd_mps.programs.launching import Launching
    from meshd_mps.programs.program import Program
    from meshd_mps.programs.registry import Registry

log = structlog.get_logger("meshd_mps")


class Recovery:
    def __init__(self, reg: Registry, launching: Launching):
        self.reg = reg
        self.launching = launching

    def install(self, p: Program) -> None:
        """``p`` the program of its name, its current launch watched."""
        self.reg.by_name[p.name] = p
        self.reg.b.start_soon(self.watch, p, p.generation, name=f"watch {p.name}")

    async def watch(self, p: Program, generation: int) -> None:
        """Await a launch's end: a failure may be a fault of its GPU (``on_failure``); a kernel
        that returned by itself is relaunched under restart policy always.  An end of ours (a halt
        for an unload or an upgrade, a close) is left alone: the lock is taken first, and by then
        the program is another generation or gone."""
        died = False
        try:
            d = await p.launch.wait()
            failed = not d.ok
        except Exception as e:
            failed, died = True, isinstance(e, WorkerError)
        if self.reg.closed() or not self.reg.current(p, generation):
            return
        if failed:
            p.to(None, failed_at=time.monotonic())
            self.reg.failed_total += 1
            self.reg.deaths_total += died
        st = p.observe()
        if st is ProgramState.FAILED:
            await self.on_failure(p, generation)
        elif st is ProgramState.EXITED and p.restart is restart.Policy.ALWAYS:
            async with self.reg.lock:
                if self.current(p, generation, ProgramState.EXITED):
                    self.after_end(p, restart.End.EXITED)

    def current(self, p: Program, generation: int, state: ProgramState) -> bool:
        """``p``'s launch of ``generation`` is still its name's, in ``state`` once its end is taken
        in (nothing dealt with it meanwhile), and the backend is not closing (its close kills every
        worker: no fault of anyone's)."""
        return not self.reg.closed() and self.reg.current(p, generation) and p.observe() is state

    def _suspect(self, q: Program, ended: bool = False) -> faults.Suspect:
        return faults.Suspect(q.name, q.kernel.pid, q.failed_at, ended=ended,
                              died=q.kernel.died_on_its_own(), error=q.state()[1],
                              kernel_error=q.kernel_error())

    async def on_failure(self, p: Program, generation: int) -> None:
        reg = self.reg
        async with reg.lock:
            if not self.current(p, generation, ProgramState.FAILED):
                return  # a recovery already dealt with it
            t0 = time.perf_counter()
            ev = await reg.b.evidence(p.device, wait=reg.d.fault_window)
            pids = ev.fatal_pids
            if not ev.gpu_wide:
                # A fault of its GPU if the server logs a fatal fault there, or other programs of
                # that GPU fail with this one (MPS tears down the clients of the faulting GPU only).
                others = [self._suspect(q) for q in reg.on_device(p.device)
                          if q is not p and q.observe() is ProgramState.FAILED]
                if not faults.is_gpu_fault(pids, faults.failed_together(self._suspect(p), others, reg.d.fault_window)):
                    error = p.state()[1]
                    reg.report(FaultReport(time.time(), error, p.name, p.kernel.pid, False, device=p.device,
                                           by="own", seen_at=p.failed_at))
                    log.error(f"program {p.name} failed: {error}", program=p.name, pid=p.kernel.pid, device=p.device)
                    p.to(None, settled=True)
                    self.after_end(p, restart.End.FAILED)
                    await reg.keep_history()
                    return
            # Blink: one context, whose error is sticky: a failure is every program's of the GPU.
            await self.recover(p, pids, t0)

    async def recover(self, first: Program, pids: list[int], t0: float) -> None:
        """Every program of ``first``'s GPU was torn down (MPS: every client; blink: the context):
        retire its workers while their successors start, held; name the culprit
        (faults.name_culprit); once the server takes clients again bring the lost programs back
        (not the culprit, whose restart policy decides: after its backoff, unless its worker was
        killed, faults.died_innocent: then with the others, in the same relaunch), then refill the
        pool.  Other GPUs are not touched."""
        reg, b = self.reg, self.reg.b
        gpu = first.device
        steps: dict[str, float] = {}
        t = t0

        def step(name: str) -> None:
            nonlocal t
            now = time.perf_counter()
            steps[name] = round((now - t) * 1e3, 2)
            t = now

        first_seen = self._suspect(first)
        # Every program of that GPU goes down with it: the ones still running fail within ms (some
        # FAILED already, not yet seen by their watchers).  One whose failure was dealt with before
        # as its own (restart policy never leaves it FAILED) is no part of this fault.
        hit = [q for q in reg.on_device(gpu)
               if (st := q.observe()) in LIVE or (st is ProgramState.FAILED and not q.settled)]
        for q in hit:
            q.to(ProgramState.LOST)  # their watchers leave them to this recovery
        step("decide")
        back = [q for q in hit if q.restart is not restart.Policy.NEVER]
        await b.teardown(gpu, ahead=len(back))  # every worker of that GPU retired and awaited
        ev = await b.evidence(gpu, ours={q.kernel.pid for q in hit})
        pids = pids or ev.fatal_pids  # the server may name the culprit only once its clients are gone
        step("teardown")
        suspects = [self._suspect(q, ended=b.mailbox.u32(q.slot, abi.STATE) == abi.EXITED) for q in hit]
        v = faults.name_culprit(suspects, first_seen, pids, ev.strays, first.failed_at or time.monotonic(),
                                reg.d.fault_window)
        named = {q.name: q for q in [first, *hit]}
        culprit = named[v.program.name] if v.program is not None else None
        if culprit is not None:
            culprit.to(ProgramState.FAULTED, v.why)
        if v.by == "first failure":
            log.info("the fault's evidence names no culprit; the first program seen failing is taken for it",
                     program=v.culprit, device=gpu)
        if v.stray is not None:
            b.took(gpu, v.stray)
        lost = [named[q.name] for q in v.lost]
        for q in lost:
            q.to(None, lost_to=v.culprit)
        r = FaultReport(time.time(), v.why, v.culprit, v.pid, True, [q.name for q in lost], device=gpu, by=v.by,
                        seen_at=first.failed_at, steps=steps)
        log.error(f"GPU fault on GPU {gpu} in program {v.culprit} (worker {v.pid}): {v.why}; "
                  f"lost with it: {', '.join(r.lost) or 'none'}", program=v.culprit, device=gpu)
        back = [q for q in lost if q.restart is not restart.Policy.NEVER]
        for q in lost:
            if q not in back:
                r.not_relaunched[q.name] = "restart policy never"
        # A program whose worker was killed goes with them, on a worker held for it, if its policy says so.
        killed = culprit if culprit is not None and faults.died_innocent(v) else None
        if killed is not None:
            dec = self.after_end(killed, restart.End.FAILED, with_recovery=True)
            if dec.relaunch:
                back.append(killed)
            else:
                r.not_relaunched[killed.name] = dec.why
        ready = await b.refill(gpu, len(back))
        ctx = b.first_context_at(gpu)
        if ctx:
            steps["server_ready"] = round(max(0.0, ctx - t) * 1e3, 2)
            t = max(t, ctx)
        step("contexts")
        if back and not ready:
            for q in back:  # tried again by their restart policy, at once
                why = r.not_relaunched[q.name] = f"GPU {gpu} took no new workers within {reg.d.recover:g}s"
                q.to(None, why)
                self.after_end(q, restart.End.LOST)
            back = []
        failed = await self.bring_back(back)
        step("relaunch")
        b.recovered(gpu)
        for q in back:
            if q.name in failed:
                r.not_relaunched[q.name] = str(failed[q.name])
                log.error(f"program {q.name}: not relaunched after the fault: {failed[q.name]}", program=q.name)
                q.to(None, f"relaunch after the fault failed: {failed[q.name]}")
                self.after_end(q, restart.End.FAILED)
            else:
                r.relaunched.append(q.name)
        if culprit is not None and culprit is not killed:
            self.after_end(culprit, restart.End.FAULTED)
        r.ms = (time.perf_counter() - t0) * 1e3
        reg.report(r)
        log.info(f"GPU {gpu}: fault recovery done in {r.ms:.0f} ms: relaunched {r.relaunched},"
                 f" not {list(r.not_relaunched)}", device=gpu, steps=steps)
        await reg.keep_history()

    # ---- restart policies ---------------------------------------------------------------------
    def after_end(self, p: Program, end: restart.End, with_recovery: bool = False) -> restart.Decision:
        """Its restart policy's decision (restart.decide) carried out: a relaunch scheduled after
        its backoff, or a crash loop declared, or nothing.  ``with_recovery``: a relaunch is the
        caller's, at once (a fault's recovery relaunching it with the innocents: the recovery is
        its backoff); its failure is counted all the same."""
        reg = self.reg
        dec = restart.decide(p.restart, end, p.failures, time.monotonic(), reg.d)
        if dec.crash_loop:
            p.to(ProgramState.CRASH_LOOP, f"{dec.why}; the last: {p.error or end.value}", failures=dec.failures)
            log.error(f"program {p.name}: {p.error}", program=p.name, failures=len(dec.failures))
            return dec
        if not dec.relaunch or reg.closed() or with_recovery:
            p.to(None, failures=dec.failures)
            if not dec.relaunch and end is not restart.End.LOST:
                log.info(f"program {p.name}: not relaunched ({dec.why})", program=p.name)
            return dec
        p.to(ProgramState.RESTARTING, failures=dec.failures, restart_at=time.monotonic() + dec.delay)
        log.warning(f"program {p.name}: relaunched in {dec.delay:g}s (restart policy {p.restart.value}, failure"
                    f" {len(dec.failures)} of {restart.CRASH_LOOP_BURST} within {reg.d.crash_loop_interval:g}s)",
                    program=p.name)
        reg.b.start_soon(self._restart_later, p, p.generation, name=f"restart {p.name}")
        return dec

    async def _restart_later(self, p: Program, generation: int) -> None:
        await anyio.sleep(max(0.0, p.restart_at - time.monotonic()))
        async with self.reg.lock:
            if not self.current(p, generation, ProgramState.RESTARTING):
                return  # unloaded, upgraded or closed meanwhile
            failed = await self.bring_back([p])
            if p.name in failed:
                p.to(None, f"relaunch failed: {failed[p.name]}")
                log.error(f"program {p.name}: {p.error}", program=p.name)
                self.after_end(p, restart.End.FAILED)
            else:
                log.info(f"program {p.name} relaunched (restart {p.restarts})", program=p.name)
            await self.reg.keep_history()

    async def relaunch(self, q: Program) -> None:
        """``q`` started again on its slot (a failed upgrade's old version); its error raised."""
        failed = await self.bring_back([q])
        if q.name in failed:
            raise failed[q.name]

    async def bring_back(self, qs: list[Program]) -> dict[str, MeshError]:
        """The programs ``qs`` relaunched on their slots, on fresh workers: every image loaded first
        (MPS: each into its own worker, at once), then every one launched, so that in blink mode no
        load halts a relaunched one.  Each one relaunched is a new generation of itself.  What
        failed, by name."""
        reg, b = self.reg, self.reg.b
        failed: dict[str, MeshError] = {}
        loaded: list[tuple[Program, Kernel, Image]] = []
        shares = {d: reg.used(d) for d in {q.device for q in qs}}  # the GPU's blocks held, the batch's added

        async def load(q: Program) -> None:
            assert q.manifest is not None

            def admit(info: frames.Loaded) -> None:
                limits.check_resident(q.name, q.nodes, info.per_sm, info.sms, shares[q.device])
                shares[q.device] += limits.share(q.nodes, info.per_sm, info.sms)

            try:
                img = await b.prepare(q.manifest, q.ptx, device=q.device, payloads=q.kernel.payloads)
                try:
                    loaded.append((q, await b.load(img, admit), img))
                except BaseException:
                    with anyio.CancelScope(shield=True):
                        await b.drop(img)
                    raise
            except MeshError as e:
                failed[q.name] = e

        async with anyio.create_task_group() as tg:
            for q in qs:
                tg.start_soon(load, q)
        # The old workers (retired already) or modules go first, their launches ended: in blink mode
        # an unload is a blink, which would halt the relaunched ones (one that is slow to see HALT
        # would refuse it).  One that cannot be unloaded is left, and said; the relaunch goes on.
        for q, _k, _img in loaded:
            try:
                await b.unload(q.kernel)
            except MeshError as e:
                log.warning(f"program {q.name}: its old module was not unloaded before its relaunch: {e}",
                            program=q.name)
        for q, k, img in loaded:
            try:
                run = await self.launching.launch(k, q.slot, q.nodes, data=q.data)
            except MeshError as e:
                failed[q.name] = e
                continue
            reg.relaunched_total += 1
            q.to(ProgramState.RUNNING, run=Run(k, run, img.prepared.hash, img.prepared.compile_ms, img.prepared.cached,
                                               q.manifest, q.ptx))
            self.install(q)
        return failed
