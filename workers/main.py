"""The worker loop: frames on stdin, frames on stdout, logs on stderr.

One request at a time from the supervisor, read on the main thread; DONE
frames come from the GPU's completion threads, so every write holds a lock.
The worker exits at QUIT at once, and at stdin EOF (which the supervisor's
death also gives) once it has halted the kernels still running (live.py); a
frame it cannot parse makes it exit with status 2, which the supervisor sees
as a death.  With ``--listen DIR`` the frames go over a Unix socket instead,
and the worker outlives its daemon (live.py).

TEST HOOK, fault injection: ``MESHD_MPS_WORKER_INJECT="phase:how[,phase:how]"``
in a worker's environment makes that worker misbehave in the reply to every
request of that phase, with the real GPU (``--gpu cuda``) as with the
simulation; the simulation's own scripted faults (``sim_gpu.misbehaviour``) are
the same, and where both name a phase the variable wins.  Phases: ``ready``,
``load``, ``launch`` (the work of the request is done first: the module is
loaded, the kernel launched).  Hows: ``hang`` (never reply), ``exit`` (exit 3),
``garbage`` (a frame length over the limit), ``wrong-op`` (a reply of another
op), ``short`` (a reply too short for its ok word), ``close-stdout`` (close
stdout, stay alive), ``unsolicited`` (the true reply, then a READY nobody asked
for).  A value that does not parse makes the worker exit at start with status 2
and an error on stderr.  Only tests set it (tests/rig/test_workers.py,
tests/gpu/test_faults_real.py); meshd-mps itself never does.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import select
import struct
import threading
import time
from collections.abc import Callable

from meshd_mps.base.deadlines import DEFAULT
from meshd_mps.protocol import frames
from meshd_mps.protocol.frames import DataReq, Done, FrameError, LaunchReq, Load, Op, PayloadsReq, WriteReq
from meshd_mps.protocol.mailbox import Mailbox
from meshd_mps.protocol.payloads import Layout

from . import live, wlog
from .gpu import Gpu, GpuError
from .warm import HOLD, MAX_QUEUES, QUEUES_ENV

log = wlog.log

EXIT_PROTOCOL = 2

#: The fault-injection test hook (see the module's docstring).
INJECT_ENV = "MESHD_MPS_WORKER_INJECT"
INJECT_PHASES = ("ready", "load", "launch")
INJECT_HOWS = ("hang", "exit", "garbage", "wrong-op", "short", "close-stdout", "unsolicited")


def parse_inject(value: str | None) -> dict[str, str]:
    """``MESHD_MPS_WORKER_INJECT``'s value as {phase: how}; ValueError naming what is wrong."""
    out: dict[str, str] = {}
    for item in (value or "").split(","):
        if not item.strip():
            continue
        phase, sep, how = item.strip().partition(":")
        if not sep or phase not in INJECT_PHASES or how not in INJECT_HOWS:
            raise ValueError(
                f"{INJECT_ENV}={value!r}: {item.strip()!r} is not phase:how with a phase of"
                f" {'/'.join(INJECT_PHASES)} and a how of {'/'.join(INJECT_HOWS)}"
            )
        out[phase] = how
    return out


class Channel:
    """The worker's end of the pipes: blocking reads on fd 0, locked writes to fd 1."""

    def __init__(self, rfd: int = 0, wfd: int = 1):
        self.rfd, self.wfd = rfd, wfd
        self._wlock = threading.Lock()
        self._buf = bytearray()  # read ahead: a frame usually arrives in one read

    def _fill(self, n: int) -> bool:
        """At least n bytes buffered; False at EOF."""
        while len(self._buf) < n:
            try:
                chunk = os.read(self.rfd, max(65536, n - len(self._buf)))
            except ConnectionError:  # a socket's daemon gone (ECONNRESET): as EOF
                chunk = b""
            if not chunk:
                return False
            self._buf += chunk
        return True

    def read(self) -> tuple[Op, bytes] | None:
        if not self._fill(frames.HEADER.size):
            if self._buf:
                raise FrameError(f"stdin closed inside a frame header ({len(self._buf)} bytes)")
            return None
        (n,) = frames.HEADER.unpack_from(self._buf)
        frames.check_length(n)
        end = frames.HEADER.size + n
        if not self._fill(end):
            raise FrameError(f"stdin closed inside a frame ({len(self._buf) - frames.HEADER.size} of {n} bytes)")
        frame = bytes(self._buf[frames.HEADER.size : end])
        del self._buf[:end]
        return frames.check_op(frame[0]), frame[1:]

    def peer_gone(self) -> bool:
        """Whether the daemon has closed its end (what it sent before may still be buffered): a READY
        it sent just before it died must not open the GPU, which would make an MPS client nobody
        owns."""
        p = select.poll()
        p.register(self.rfd, select.POLLIN)
        return any(ev & (select.POLLHUP | select.POLLERR) for _, ev in p.poll(0))

    def write_raw(self, data: bytes) -> None:
        with self._wlock:
            view = memoryview(data)
            while view:
                k = os.write(self.wfd, view)
                view = view[k:]

    def write(self, op: Op, body: bytes = b"") -> None:
        self.write_raw(frames.encode(op, body))


def _misbehave(ch: Channel, how: str | None, op: Op, reply: bytes, injected: bool = False) -> bool:
    """Carry out a scripted fault (the simulation's, or injected through ``MESHD_MPS_WORKER_INJECT``);
    True if the reply is replaced."""
    if how is None:
        return False
    log.warning("injected misbehaviour" if injected else "simulated misbehaviour", how=how, op=op.name)
    if how == "hang":
        threading.Event().wait()
    if how == "exit":
        os._exit(3)
    if how == "garbage":
        ch.write_raw(b"\xff\xff\xff\x7fgarbage")
    elif how == "wrong-op":
        ch.write(Op.LAUNCHED if op != Op.LAUNCHED else Op.LOADED, frames.ok_reply())
    elif how == "short":
        ch.write(op, b"\x01")
    elif how == "close-stdout":
        os.close(ch.wfd)
        threading.Event().wait()
    elif how == "unsolicited":  # the true reply, then one nobody asked for
        ch.write(op, reply)
        ch.write(Op.READY, frames.ready_reply(os.getpid()))
    else:
        raise SystemExit(f"unknown simulated misbehaviour {how!r}")
    return True


class Opened:
    """The worker's GPU, once opened: at start, or (``--hold``) at the first READY, asked again at
    each READY until it opens (the MPS server may refuse clients for a while after a fault)."""

    def __init__(self, open: Callable[[], tuple[Gpu | None, str | None]], hold: bool = False):
        self._open: Callable[[], tuple[Gpu | None, str | None]] | None = open
        self.gpu: Gpu | None = None
        self.error: str | None = None
        if not hold:
            self.ready()

    def ready(self) -> None:
        """At start, or at a READY: open the GPU if it is not open yet (once, unless held)."""
        if self._open is None:
            return
        self.gpu, self.error = self._open()
        if self.gpu is not None:
            self._open = None


def serve(ch: Channel, gpu: Opened, inject: dict[str, str] | None = None, link: live.Link | None = None) -> int | None:
    """Answer requests until EOF or QUIT; returns the exit status at QUIT (or a protocol error),
    None at EOF or once the daemon is gone.  ``inject``: the test hook's faults by phase
    (``parse_inject``), before the GPU's own ``misbehaviour``.  ``link``: where DONEs go and what
    runs is kept (live.py); without one, DONEs go to ``ch``."""
    inject = inject or {}
    try:
        return _serve(ch, gpu, inject, link)
    except (BrokenPipeError, ConnectionError):  # a reply to a daemon that is gone
        return None


def _serve(ch: Channel, opened: Opened, inject: dict[str, str], link: live.Link | None) -> int | None:
    gpu = opened.gpu

    def misbehave(phase: str, op: Op, reply: bytes) -> bool:
        assert gpu is not None
        how = inject.get(phase)
        if how is not None:
            return _misbehave(ch, how, op, reply, injected=True)
        return _misbehave(ch, gpu.misbehaviour(phase), op, reply)

    def on_done(d: Done) -> None:
        if link is not None:
            link.done(d)
            return
        with contextlib.suppress(OSError):  # the supervisor is gone; stdin EOF ends the loop
            ch.write(Op.DONE, d.encode())

    while True:
        try:
            got = ch.read()
        except FrameError as e:
            log.error("bad frame from the supervisor; exiting", error=str(e))
            return EXIT_PROTOCOL
        if got is None:
            if gpu is not None and gpu.misbehaviour("eof") == "ignore":
                threading.Event().wait()
            return None
        op, body = got
        if op == Op.READY and not ch.peer_gone():
            opened.ready()
            gpu = opened.gpu
        if op == Op.QUIT:
            if gpu is not None and gpu.misbehaviour("quit") == "ignore":
                continue
            return 0
        if gpu is None:
            if op in frames.REPLY:
                ch.write(frames.REPLY[op], frames.error_reply(opened.error or "no GPU"))
            continue
        try:
            if op == Op.READY:
                reply = frames.ready_reply(os.getpid())
                if not misbehave("ready", Op.READY, reply):
                    ch.write(Op.READY, reply)
            elif op == Op.LOAD:
                load = Load.decode(body)
                try:
                    t0 = time.monotonic()
                    info = gpu.load(load)
                    ms = round((time.monotonic() - t0) * 1e3, 2)
                    log.info("module loaded", program=load.name, module=load.module, ms=ms)
                    if link is not None:
                        link.loaded(load.module, load.name, load.tag, info)
                    reply = info.encode()
                except GpuError as e:
                    reply = frames.error_reply(str(e), word=e.word)
                if not misbehave("load", Op.LOADED, reply):
                    ch.write(Op.LOADED, reply)
            elif op == Op.LAUNCH:
                launch = LaunchReq.decode(body)
                if link is not None:
                    link.launching(launch.module, launch.gen, launch.slot, launch.nodes)
                try:
                    gpu.launch(launch.module, launch.gen, launch.slot, launch.nodes, on_done)
                    reply = frames.ok_reply()
                except GpuError as e:
                    reply = frames.error_reply(str(e))
                    if link is not None:
                        link.not_launched(launch.module, launch.gen)
                started = getattr(gpu, "launched", None)  # the simulation starts its kernels here
                if started is not None and (inject.get("launch") or gpu.misbehaviour("launch")) == "hang":
                    started()  # the reply hangs, the kernel runs meanwhile: launched, as on a GPU
                if not misbehave("launch", Op.LAUNCHED, reply):
                    ch.write(Op.LAUNCHED, reply)
                if started is not None:
                    started()
            elif op == Op.LIMIT:
                _answer(ch, op, functools.partial(_limit, gpu, frames.limit_request(body)))
            elif op == Op.DATA:
                _answer(ch, op, functools.partial(_data, gpu, DataReq.decode(body)))
            elif op == Op.WRITE:
                _answer(ch, op, functools.partial(_write, gpu, WriteReq.decode(body)))
            elif op == Op.PAYLOADS:
                _answer(ch, op, functools.partial(_payloads, gpu, PayloadsReq.decode(body)))
            elif op == Op.UNLOAD:
                module = frames.unload_module(body)
                try:
                    gpu.unload(module)
                    if link is not None:
                        link.unloaded(module)
                except GpuError as e:
                    log.error("unload failed", module=module, error=str(e))
            else:
                log.error("unexpected op from the supervisor; exiting", op=op.name)
                return EXIT_PROTOCOL
        except FrameError as e:
            log.error("bad frame from the supervisor; exiting", op=op.name, error=str(e))
            return EXIT_PROTOCOL


def _answer(ch: Channel, op: Op, reply: Callable[[], bytes]) -> None:
    """A request answered by its own op: ``reply()``'s body, or the GPU's error."""
    try:
        body = reply()
    except GpuError as e:
        body = frames.error_reply(str(e))
    ch.write(op, body)


def _data(gpu: Gpu, req: DataReq) -> bytes:
    """DATA: the slot's program data placed (or freed), logged with its time."""
    t0 = time.monotonic()
    dev = gpu.data(req)
    log.info("program data placed" if req.alloc else "program data freed", slot=req.slot, bytes=req.alloc,
             copied=req.length, ms=round((time.monotonic() - t0) * 1e3, 2))
    return frames.data_reply(dev, req.alloc)


def _limit(gpu: Gpu, set_to: int | None) -> bytes:
    """LIMIT: the context's stack limit, set first if asked."""
    return frames.ok_reply(struct.pack("<Q", gpu.stack_limit(set_to)))


def _payloads(gpu: Gpu, req: PayloadsReq) -> bytes:
    """PAYLOADS: the module's payload region mapped and registered, logged; its device address."""
    dev = gpu.payloads(req.module, req.path, Layout(req.max_request, req.max_response))
    log.info("payload region mapped", module=req.module, path=req.path, max_request=req.max_request,
             max_response=req.max_response)
    return frames.ok_reply(struct.pack("<Q", dev))


def _write(gpu: Gpu, req: WriteReq) -> bytes:
    """WRITE: answered once the copy is complete on the device."""
    gpu.write(req)
    return frames.ok_reply()


def _queues(v: str) -> int:
    """``--queues``: digits only (what warm.py reads too), at most the driver's maximum."""
    if not v.isdigit():
        raise argparse.ArgumentTypeError(f"{v!r} is not a count of hardware work queues")
    n = int(v)
    if n > MAX_QUEUES:
        raise argparse.ArgumentTypeError(
            f"{n}: the driver takes at most {MAX_QUEUES} hardware work queues ({QUEUES_ENV})"
        )
    return n


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The worker's options.  No abbreviations: warm.py reads --gpu, --sms, --device and --queues
    from argv itself (before this module is imported), and must read the same."""
    ap = argparse.ArgumentParser(
        prog="meshd-mps worker", description="One MPS client process of meshd-mps (started by the daemon).",
        allow_abbrev=False,
    )
    ap.add_argument("--mailbox", required=True, help="path of the mailbox (a memfd's /proc/PID/fd/N, or a file)")
    ap.add_argument("--sms", type=int, default=0, help="a green context of this many SMs (0: the whole device)")
    ap.add_argument(
        "--gpu", choices=("cuda", "sim"), default="cuda", help="the real GPU, or the CPU simulation for tests"
    )
    ap.add_argument("--device", type=int, default=0, help="the GPU's CUDA ordinal (default 0)")
    ap.add_argument("--queues", type=_queues, default=0, metavar="N",
                    help=f"hardware work queues of the context ({QUEUES_ENV}, set before cuInit; at most {MAX_QUEUES};"
                         " 0: the driver's default, 8)")
    ap.add_argument(HOLD, action="store_true",
                    help="start without a context: import, then create it at the first READY (a worker started ahead"
                         " while the MPS server does not take clients yet)")
    ap.add_argument("--examples", metavar="LIST",
                    help="--gpu sim: the shipped examples' cubins, name=cubin id,... (sha256's first 16 hex digits; the daemon's;"
                         " default: compiled here)")
    ap.add_argument("--listen", metavar="DIR",
                    help="serve the frames on the Unix socket DIR/<pid>.sock (one daemon at a time, each greeted"
                         " with HELLO) instead of stdin/stdout, and outlive the daemon (live restore)")
    ap.add_argument("--orphan-timeout", type=float, default=DEFAULT.orphan, metavar="S",
                    help="with --listen: how long the kernels run on with no daemon connected before they are"
                         f" halted and the worker exits (default {DEFAULT.orphan:g})")
    ap.add_argument("--halt-within", type=float, default=DEFAULT.orphan_halt, metavar="S",
                    help="at stdin EOF or the orphan timeout: how long the worker waits for the kernels it halted"
                         f" (default {DEFAULT.orphan_halt:g})")
    return ap.parse_args(argv)


#: A worker's oom_score_adj: the OOM killer takes ordinary processes (0) before a resident
#: program's worker, whose death ends the program (and, under MPS with its kernel running, faults
#: the GPU's other clients).  Not -1000 (never): a runaway worker must still be killable.
OOM_SCORE_ADJ = -500


def protect_from_oom(path: str = "/proc/self/oom_score_adj") -> str:
    """Lower this process's oom_score_adj to OOM_SCORE_ADJ where that is permitted (lowering needs
    CAP_SYS_RESOURCE); what happened, in words, for the log."""
    try:
        with open(path, "w") as f:
            f.write(str(OOM_SCORE_ADJ))
    except OSError as e:
        return f"oom_score_adj not lowered ({e.strerror}): the OOM killer treats this worker as any process"
    return f"oom_score_adj {OOM_SCORE_ADJ}"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)  # --queues is in the environment already: warm.start put it there, before cuInit
    wlog.setup(component="worker")
    wlog.bind(pid=os.getpid(), device=args.device)
    log.debug("worker up", oom=protect_from_oom())
    try:
        inject = parse_inject(os.environ.get(INJECT_ENV))
    except ValueError as e:
        log.error("bad fault-injection test hook; exiting", error=str(e))
        return EXIT_PROTOCOL
    if inject:
        log.warning("fault injection (a test hook) is on", inject=inject)
    # Before the GPU opens, so that the daemon connects at once; it accepts once the GPU is open.
    try:
        listener = live.Listener(args.listen) if args.listen else None
    except OSError as e:
        log.error("cannot listen; exiting", dir=args.listen, error=str(e))
        return EXIT_PROTOCOL
    mailbox: Mailbox | None = None
    try:
        mailbox = Mailbox.open(args.mailbox)
        mailbox.doorbell = args.gpu == "sim"  # its own HALTs (halt_all) ring too
    except Exception as e:  # reported on the first request, as a GPU that did not open
        log.error("mailbox not opened", error=str(e))
        no_mailbox = f"worker {os.getpid()}: {e}"
    gpus: list[Gpu] = []

    def open_gpu() -> tuple[Gpu | None, str | None]:
        """The GPU (its context); any failure to come up is reported on the first request."""
        if mailbox is None:
            return None, no_mailbox
        try:
            if args.gpu == "sim":
                from .sim_gpu import SimGpu

                gpu: Gpu = SimGpu(mailbox, args.sms, args.device, args.examples)
            else:
                from . import warm
                from .cuda_gpu import CudaGpu

                warm.release()
                gpu = CudaGpu(mailbox, args.sms, warm.take(), args.device)
        except Exception as e:
            log.error("GPU not opened", error=str(e))
            return None, f"worker {os.getpid()}: {e}"
        gpus.append(gpu)
        return gpu, None

    if args.hold:  # imported now, while held: the READY then only opens the GPU
        if args.gpu == "cuda":
            from . import cuda_gpu  # noqa: F401
        else:
            from . import sim_gpu  # noqa: F401
    opened = Opened(open_gpu, hold=args.hold)
    link = live.Link(args.device, args.mailbox)

    def serve_on(rfd: int, wfd: int, hello: bool) -> int | None:
        ch = Channel(rfd, wfd)
        try:
            link.attach(ch, hello)
        except OSError as e:
            log.warning("the daemon left before its HELLO", error=str(e))
            return None
        return serve(ch, opened, inject, link)

    try:
        if listener is None:
            return live.run_piped(serve_on, link, mailbox, args.halt_within)
        return live.run_listening(serve_on, link, listener, mailbox, args.orphan_timeout, args.halt_within)
    finally:
        for g in gpus:
            g.close()
