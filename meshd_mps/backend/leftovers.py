"""What an earlier meshd-mps with live restore left behind: where it lives (``live_paths``), its
workers adopted or dismissed at open (``adopt``), and, for a start without live restore, all of it
halted and ended (``clear_left``).

The kernels such a run left may still beat in its mailbox: one that no worker of ours runs must not
exit with its kernel running (under MPS that faults the GPU), nor share a slot with a new program,
so it is halted through the mailbox first (``halt_slots``).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
from collections.abc import Collection
from dataclasses import dataclass, field

import anyio
import structlog

from meshd_mps.backend import payloads
from meshd_mps.base.errors import MailboxError, MpsError, ProtocolMismatch, WorkerError, WorkerGone
from meshd_mps.mps.control import ControlDaemon, Owner
from meshd_mps.protocol import abi
from meshd_mps.protocol.mailbox import Mailbox
from meshd_mps.supervision.proc import WorkerProc
from meshd_mps.supervision.supervisor import Supervisor

log = structlog.get_logger("meshd_mps")

#: Where the live-restore mailbox lives: shared memory (tmpfs).  The GPU maps the mailbox as host
#: memory (cuMemHostRegister), which the H200's driver refused for a regular file's pages
#: (CUDA_ERROR_INVALID_VALUE) and takes for shmem, as for the memfd without live restore.
SHM_DIR = "/dev/shm"


@dataclass(frozen=True)
class LivePaths:
    """What outlives the daemon for a live-restore directory (the state dir)."""

    mailbox: str  # the mailbox every worker maps: a file in SHM_DIR named after the state dir, this user's
    mps: str  # the MPS control daemon's directory (pipes, logs, its marker)
    workers: str  # each worker's <pid>.sock and <pid>.log


def live_paths(dir: str) -> LivePaths:
    d = os.path.abspath(dir)  # the workers compare the mailbox path they were given with ours
    tag = hashlib.sha256(os.fsencode(d)).hexdigest()[:16]
    return LivePaths(os.path.join(SHM_DIR, f"meshd-mps.{os.getuid()}.{tag}.mailbox"), os.path.join(d, "mps"),
                     os.path.join(d, "workers"))


def live_mailbox(path: str) -> Mailbox:
    """The mailbox an earlier meshd-mps left (its kernels may run on it: its contents kept), else a
    new one."""
    if os.path.exists(path):
        try:
            return Mailbox.open(path)
        except MailboxError as e:
            log.warning(f"live restore: {e}; making a new one")
    return Mailbox.create(path)


def _sockets(d: str) -> list[str]:
    try:
        return sorted(os.path.join(d, n) for n in os.listdir(d) if n.endswith(".sock"))
    except FileNotFoundError:
        return []


@dataclass
class WorkersLeft:
    """What adoption did with each worker left (for status and the log), and each GPU's kept workers,
    for its isolation to take in."""

    kept: dict[int, list[WorkerProc]] = field(default_factory=dict)
    report: dict[str, list[int]] = field(default_factory=lambda: {"adopted": [], "dismissed": [], "gone": []})


async def adopt(sup: Supervisor, mailbox: Mailbox, live: str, devices: Collection[int], keeps_workers: bool) -> WorkersLeft:
    """Live restore: every worker an earlier meshd-mps left on its socket under ``live``, adopted (its
    HELLO: what it runs).  Those this backend cannot keep (another protocol version, another mailbox,
    a GPU not in ``devices``, clients of an MPS server that is gone: not ``keeps_workers``) have
    their kernels halted through the mailbox and are told to QUIT; every slot that no kept worker
    runs on is zeroed."""
    out = WorkersLeft()
    kept: list[WorkerProc] = []
    unwanted: list[WorkerProc] = []
    unheard = False  # a worker that may live on without being ours to keep: a kernel of it may still run
    for path in _sockets(live_paths(live).workers):
        try:
            w = await sup.adopt(path)
        except ProtocolMismatch as e:
            log.warning(f"live restore: {e}: its programs are reloaded", pid=e.pid, theirs=e.theirs, ours=e.ours)
            unheard = True
            continue
        except WorkerError as e:  # gone, not ours (PeerMismatch), or no HELLO
            log.warning(f"live restore: {path}: {e}", pid=e.pid)
            if isinstance(e, WorkerGone):
                out.report["gone"].append(e.pid or 0)
            else:
                unheard = True
            continue
        if why := not_kept(w, mailbox, devices, keeps_workers):
            log.warning(f"live restore: worker {w.pid} not kept: {why}", pid=w.pid)
            unwanted.append(w)
        else:
            kept.append(w)
    keep = {la.slot for w in kept for la in (w.hello.launches if w.hello else ()) if la.running}
    stale = [s for s in range(abi.SLOTS) if s not in keep and mailbox.u32(s, abi.STATE) == abi.RUNNING]
    if stale and (unwanted or unheard):
        await halt_slots(mailbox, stale, sup.deadlines.halt)
    elif stale:
        # Every worker that could run a kernel there is gone (a kernel ends with its process and its
        # context): the words are what the dead left, not a kernel to halt and wait 5 s for.
        log.info(f"live restore: slots {stale} said RUNNING, but their workers are gone: zeroed", slots=stale)
    for w in unwanted:
        sup.retire(w, before_exit=False)
    out.report["dismissed"] = [w.pid for w in unwanted] + await sup.dismiss()
    for s in range(abi.SLOTS):
        if s not in keep:
            mailbox.reset_slot(s)
    out.report["adopted"] = sorted(w.pid for w in kept)
    for w in kept:
        out.kept.setdefault(w.device, []).append(w)
    return out


def not_kept(w: WorkerProc, mailbox: Mailbox, devices: Collection[int], keeps_workers: bool) -> str:
    """Why an adopted worker cannot be kept ("": it can)."""
    assert w.hello is not None
    if not keeps_workers:
        return "its MPS server is gone"
    if w.hello.mailbox != mailbox.path:
        return f"it maps mailbox {w.hello.mailbox}, not ours"
    if w.device not in devices:
        return f"its GPU {w.device} is not served here"
    return ""


async def halt_slots(mb: Mailbox, slots: list[int], halt: float, ending: bool = False) -> None:
    """HALT on ``slots`` of ``mb``, whose kernels no worker of ours runs (left by workers we cannot
    keep), and their STATE awaited off RUNNING within ``halt`` (``Deadlines.halt``): they must not
    exit with a kernel running (under MPS that faults the GPU), nor share a slot with a new one."""
    for s in slots:
        mb.halt(s)
    with anyio.move_on_after(halt):
        while any(mb.u32(s, abi.STATE) == abi.RUNNING for s in slots):
            await anyio.sleep(0.005)  # the kernels answer in host memory: nothing to await but the words
    left = [s for s in slots if mb.u32(s, abi.STATE) == abi.RUNNING]
    why = ("without live restore: halted the kernels an earlier meshd-mps left on slots {}" if ending
           else "live restore: halted the kernels on slots {} that no adopted worker runs")
    log.info(why.format(slots), still_running=left)
    if left:
        who = "without live restore" if ending else "live restore"
        log.error(f"{who}: slots {left} still RUNNING {halt:g}s after HALT (no kernel answers there, or"
                  " one that ignores HALT); they are zeroed and reused", slots=left)


async def clear_left(sup: Supervisor, dir: str) -> None:
    """Without live restore: what an earlier meshd-mps with live restore left under ``dir`` (workers
    on sockets, their kernels, the MPS daemon, the mailbox file and the payload regions) halted and ended, so that nothing
    of it runs on unseen: kernels halted through that mailbox, workers told to QUIT (killed past
    ``retire_quit``), the daemon adopted and quit."""
    paths = live_paths(dir)
    socks = _sockets(paths.workers)
    mb = None
    if socks:
        try:
            mb = Mailbox.open(paths.mailbox)
        except MailboxError as e:
            log.error(f"left by live restore: {e}: its kernels cannot be halted")
    try:
        ws: list[WorkerProc] = []
        for path in socks:
            try:
                ws.append(await sup.adopt(path, to_end=True))
            except WorkerError as e:  # ProtocolMismatch too: kept by the supervisor for dismiss
                log.warning(f"left by live restore: {path}: {e}", pid=e.pid)
        if mb is not None:
            running = [s for s in range(abi.SLOTS) if mb.u32(s, abi.STATE) == abi.RUNNING]
            if running:
                await halt_slots(mb, running, sup.deadlines.halt, ending=True)
        for w in ws:
            sup.retire(w, before_exit=False)
        dismissed = await sup.dismiss()
        d = sup.deadlines
        with anyio.move_on_after(d.retire_quit + d.retire_kill):
            for w in ws:
                await w.process.wait()
        if ws or dismissed:
            log.warning(f"without live restore: {len(ws) + len(dismissed)} workers an earlier meshd-mps left"
                        f" running in {paths.workers} halted and ended", pids=[w.pid for w in ws] + dismissed)
    finally:
        if mb is not None:
            mb.close()
    with contextlib.suppress(FileNotFoundError):
        os.unlink(paths.mailbox)
    payloads.sweep(paths.mailbox)  # the programs' payload regions beside it
    if Owner.read(paths.mps) is not None:  # a marker: a daemon of ours may run there
        left = ControlDaemon(paths.mps, temporary=False, deadlines=sup.deadlines)
        try:
            await left.adopt()
        except MpsError:
            return  # none runs there (or not ours to quit: its meshd-mps is alive)
        log.warning(f"without live restore: the MPS control daemon {left.pid} left in {paths.mps} quit")
        await left.quit()
