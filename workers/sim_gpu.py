"""The simulated GPU (``--gpu sim``): kernels that run on the CPU, for tests.

Chosen only by that flag, never as a fallback.  It exercises every path of
the supervisor on a machine with no GPU: "context creation" connects to the
stand-in MPS daemon (so the client lists are real), kernels are threads that
read and write the real mailbox, and a script in the image makes the worker
finish, fail, hang, die or break the protocol where a test wants it.

The image ("cubin") is either a script, ``MESHSIM1`` then a JSON object, or a
real cubin (an ELF from nvJitLink).  The simulation does not run GPU code, and
says so: a real cubin that is a shipped example's (heartbeat, echo, spin, fault, peek;
recognised by the cubin's own bytes, never by the program's name nor LOAD's ``tag``:
meshd_mps/gpu/examples.py) runs as that example, with a warning at load; any
other is refused at load (sim_images.py, pointing to ``meshd-mps check``), as
is one without the entry ``mesh_main`` (in the real driver's words).  Refusals
are the image's fault: GpuError(refused=True), or word=frames.NO_ENTRY
(LOADED's ok word, as CudaGpu sends it); ImageRefused in the daemon.

Script keys (all optional):
  kernel: sleep | fail | hang | exit | heartbeat | echo | spin | fault | peek (reads its data: sim_data.py)
  ms: run time of sleep/fail (default 0); message: fail's error text
  start: false  (never write STATE = RUNNING; otherwise as its kernel)
  pause_after, pause_ms: heartbeat/echo stop beating after that many beats, for
      pause_ms (0: until HALT), still seeing HALT: a stalled program
  answer_bytes, answer_at: echo answers every request over 188 bytes with that
      length at that offset of its payload region (a misbehaving program)
  entry: false  (the image has no mesh_main: refused at load)
  load, launch, ready: a protocol fault in that reply: hang | exit | garbage |
      wrong-op | short | close-stdout | unsolicited | error:<text>
  quit: ignore  (ignore QUIT and stdin EOF)
  load_ms: delay before LOADED; rt_abi, regs, local, per_sm, sms: reported values
Every kernel writes STATE = RUNNING in its slot when it starts (the ABI asks it
of every program), unless ``start`` is false; heartbeat and echo where their sources do, echo
after its ring helpers marked the slot served (SERVES), which no other kernel writes.
Startup faults come from MESHD_MPS_SIM_STARTUP (same values as ``ready``, plus
``no-mps``: do not connect to the daemon, like a worker with another pipe dir; ``mps-lost``:
the connection fails with CUDA_ERROR_MPS_CONNECTION_FAILED and fd 0 is closed, as the H200's
driver left it when the MPS server was shutting down).

What the H200 does to resident kernels, simulated so that tests fail where the
GPU would: the context has ``CUDA_DEVICE_MAX_CONNECTIONS`` hardware work queues
(read at construction, as the driver reads it at cuInit; workers/warm.py), a
module takes one as CudaGpu gives it a stream (workers.gpu.Streams), and a
kernel starts only once every earlier kernel of its queue has ended.  And a
resident kernel needs its whole grid on the GPU at once: the context holds
``per_sm * sms`` blocks of a module (``per_sm`` as reported, ``sms`` the
context's), a kernel of ``nodes`` blocks holds ``nodes / (per_sm * sms)`` of
it, and one that does not fit beside the running ones waits until it does
(the GPU does not preempt).  A kernel that waits has not started: it neither
runs nor writes STATE.

A SIGKILLed CUDA client on the H200 stays in its exit for ~0.2 s while the driver tears its
context down, its pipes still open: the server faults the other clients at once, the supervisor
reads the client's EOF later.  ``$MESHD_MPS_SIM_EXIT_LINGER`` (seconds; tests set it) makes the
simulated client do the same: a child of it holds its stdout open that long after it dies.

Several GPUs: ``--device N`` of ``$MESHD_MPS_SIM_GPUS`` (default 1; another
ordinal is refused as cuDeviceGet refuses it); the worker tells the stand-in
daemon its device (``HELLO <pid> <device>``), which counts clients and tears
them down per device, and its mailbox's "device address" differs per GPU.

The resident examples' own code (heartbeat's beat, echo's ring helpers) is sim_kernels.py's: it is
what runs on the GPU, not the GPU.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import socket
import threading
import time
from collections import deque
from dataclasses import dataclass
from fractions import Fraction

from meshd_mps.protocol import abi, frames
from meshd_mps.protocol.frames import DataReq, Done, Load, Loaded, WriteReq
from meshd_mps.protocol.mailbox import Mailbox
from meshd_mps.protocol.payloads import Layout

from . import pipes, wlog
from .gpu import DoneCallback, GpuError, Streams
from .hostmem import PayloadRegions, check_shared, sim_register
from .sim_data import SimRegions
from .sim_images import Examples
from .sim_kernels import POLLER, Script, resident
from .sim_turns import turn_of
from .warm import driver_queues

log = wlog.log

MAGIC = b"MESHSIM1"
SIM_SMS = 132
FAKE_DEV = 0x7F00_0000_0000  # a recognisable "device address" of the mailbox
STARTUP_ENV = "MESHD_MPS_SIM_STARTUP"
EXIT_LINGER_ENV = "MESHD_MPS_SIM_EXIT_LINGER"
#: What the H200's driver said to an idle client's call once its control daemon was killed.
RPC_FAILURE = (
    "CUDA_ERROR_MPS_RPC_FAILURE (the remote procedural call between the MPS server and the MPS client failed;"
    " simulated)"
)
#: The kernels that write STATE = RUNNING themselves, after their set-up, as their sources do.
RESIDENT = ("heartbeat", "echo", "peek", "knn")
#: cuModuleGetFunction's text on the H200 for an image without the entry.
NO_ENTRY = frames.DRIVER_NO_ENTRY


@dataclass
class _Module:
    id: int  # the worker's module number
    name: str
    script: Script
    threads: int
    scratch: int
    queue: int  # its hardware work queue
    per_sm: int  # blocks of it that fit one SM (as reported in LOADED)
    launched: int = 0  # kernels launched and not yet ended (under SimGpu._cv)


@dataclass(eq=False)
class _Kernel:
    """One launch on its way: queued on its module's hardware queue until it may start."""

    module: _Module
    share: Fraction  # of the context's resident blocks
    nodes: int  # its blocks
    started: bool = False


def _script_of(req: Load, examples: Examples) -> tuple[Script, str | None]:
    """The image's script, and the example a real cubin runs as (None for a script): the example
    whose cubin it is; GpuError, refused, for an image the simulation (or the driver)
    would not run."""
    if req.cubin.startswith(MAGIC):
        try:
            s = json.loads(req.cubin[len(MAGIC) :])
        except ValueError as e:
            raise GpuError(
                f"cuModuleLoadData: CUDA_ERROR_INVALID_IMAGE (simulated: bad script: {e})", refused=True
            ) from e
        if not isinstance(s, dict):
            raise GpuError(
                "cuModuleLoadData: CUDA_ERROR_INVALID_IMAGE (simulated: script is not an object)", refused=True
            )
        if s.get("entry", True) is False:
            raise GpuError(NO_ENTRY, word=frames.NO_ENTRY)
        return s, None
    if not req.cubin.startswith(b"\x7fELF"):
        raise GpuError("cuModuleLoadData: CUDA_ERROR_INVALID_IMAGE (device kernel image is invalid)", refused=True)
    if b"\0" + abi.ENTRY.encode() + b"\0" not in req.cubin:  # a whole entry of the symbol string table
        raise GpuError(NO_ENTRY, word=frames.NO_ENTRY)
    kind = examples.example_of(req.name, req.tag, req.cubin)
    return {"kernel": kind}, kind


def _linger_at_exit(seconds: float) -> None:
    """A child that holds this process's frame pipe to the daemon (its stdout, workers/pipes.py),
    and nothing else, open until ``seconds`` after this process has died (``EXIT_LINGER_ENV``);
    the fork's only thread sleeps, then exits."""
    parent = os.getpid()
    out = (pipes.taken() or (0, 1))[1]
    if os.fork() != 0:
        return
    try:
        null = os.open(os.devnull, os.O_RDWR)
        os.dup2(out, 1)
        os.dup2(null, 0)
        os.dup2(null, 2)
        os.closerange(3, os.sysconf("SC_OPEN_MAX"))  # the server's socket too: it sees the death at once
        while os.getppid() == parent:
            time.sleep(0.005)
        time.sleep(seconds)
    finally:
        os._exit(0)


class SimGpu:
    def __init__(self, mailbox: Mailbox, sms: int, device: int = 0, examples: str | None = None):
        """``examples``: the known images as the daemon computed them (``--examples``); None: computed
        here, at the first real cubin."""
        from meshd_mps.gpu.device import simulated_count, simulated_device, simulated_memory

        self.mailbox = mailbox
        self.startup = os.environ.get(STARTUP_ENV, "")
        try:
            n = simulated_count()
        except Exception as e:  # ConfigError: a bad MESHD_MPS_SIM_GPUS
            raise GpuError(f"cuInit: CUDA_ERROR_NO_DEVICE (simulated: {e})") from e
        if not 0 <= device < n:
            raise GpuError(f"cuDeviceGet: CUDA_ERROR_INVALID_DEVICE (simulated: device {device}; {n} GPUs, 0-{n - 1})")
        self.device = device
        if sms < 0 or sms > SIM_SMS:
            raise GpuError(
                f"cuDevSmResourceSplitByCount: CUDA_ERROR_INVALID_RESOURCE_CONFIGURATION ({sms} of {SIM_SMS} SMs)"
            )
        self.sms = -(-sms // 8) * 8 if sms else SIM_SMS  # green contexts come in multiples of 8 SMs
        check_shared(mailbox.fd, f"the mailbox {mailbox.path}")
        self._examples = Examples(examples, simulated_device(device))
        self._data = SimRegions(simulated_memory(), device)  # the programs' data, by slot (sim_data.py)
        self._client: socket.socket | None = None
        self._modules: dict[int, _Module] = {}
        self._pending: list[threading.Thread] = []
        self._stack = 1024  # the driver's default stack limit, bytes per thread
        self._quit = "ignore" if self.startup == "ignore-quit" else None
        self._poison: str | None = None  # a sticky error: every later call fails with it
        self._server_lost: str | None = None  # calls fail with it; running kernels go on, unreported
        self._on_gpu = 0  # kernels launched and not yet ended (the stand-in server is told 0 <-> 1)
        self._on_gpu_lock = threading.Lock()
        # The hardware: its work queues (each a FIFO of kernels; the head may run) and the part of
        # the resident blocks the running kernels hold, under one condition that every end signals.
        self._streams = Streams(range(driver_queues()))
        self._hw: list[deque[_Kernel]] = [deque() for _ in self._streams.streams]
        self._used = Fraction(0)
        self._cv = threading.Condition()
        self._pong = threading.Event()
        self._regions = PayloadRegions(mailbox, sim_register(device), lambda _kept: None)
        self._connect()
        if self._client is not None:
            threading.Thread(target=self._listen, args=(self._client,), name="sim mps client", daemon=True).start()
        if linger := float(os.environ.get(EXIT_LINGER_ENV) or 0):
            _linger_at_exit(linger)

    def _connect(self) -> None:
        from meshd_mps.standin import StandinRefused, connect_client

        if self.startup == "no-mps":
            return
        if self.startup == "mps-lost":  # the server going away under the connect, as the H200 saw it
            with contextlib.suppress(OSError):  # closed already by an earlier try (each READY tries again)
                os.close(0)  # what its driver left behind: fd 0 closed (workers/pipes.py)
            raise GpuError("cuCtxCreate: CUDA_ERROR_MPS_CONNECTION_FAILED (simulated: the MPS server is gone)")
        pipe = os.environ.get("CUDA_MPS_PIPE_DIRECTORY", "/tmp/nvidia-mps")
        try:
            self._client = connect_client(pipe, os.getpid(), device=self.device)
        except StandinRefused as e:
            raise GpuError(f"cuCtxCreate: CUDA_ERROR_MPS_MAX_CLIENTS_REACHED ({e})") from e
        except OSError as e:
            raise GpuError(f"cuCtxCreate: CUDA_ERROR_MPS_CONNECTION_FAILED ({e})") from e
        log.debug("simulated context", mps=self._client is not None, sms=self.sms, device=self.device)

    def _listen(self, sock: socket.socket) -> None:
        """What the (stand-in) MPS server tells its clients: a fatal fault tears all down; PONG
        answers a call's PING (so a call sees whatever the server said before it)."""
        buf = b""
        while True:
            try:
                data = sock.recv(4096)
            except OSError:
                data = b""
            if not data:
                if self._client is not None and not self._poison:
                    # The control daemon died (the stand-in's clients hang up on it).  As on the H200: a
                    # kernel that runs goes on, but no completion is reported any more, and every call fails.
                    self._server_lost = RPC_FAILURE
                self._pong.set()
                return
            *lines, buf = (buf + data).split(b"\n")
            for line in lines:
                if line == b"FAULT":
                    self._poisoned("CUDA_ERROR_ILLEGAL_ADDRESS: an illegal memory access was encountered (simulated)")
                elif line == b"TERMINATED":
                    self._poisoned(
                        "CUDA_ERROR_MPS_CLIENT_TERMINATED: the MPS client has been terminated by the server (simulated)"
                    )
                elif line == b"PONG":
                    self._pong.set()

    def _poisoned(self, error: str) -> None:
        """A sticky error: kernels still waiting for their queue or for room end with it, unrun."""
        with self._cv:
            self._poison = error
            self._cv.notify_all()
        POLLER.wake_all()  # the parked kernels end now, as a poisoned context's do

    def _check(self, call: str, rpc: bool = False) -> None:
        """A call of the driver: the client's sticky error if it has one.  ``rpc``: a round trip to
        the server first (a module load's), so that the call sees whatever the server said before
        it; a launch's hot path goes without."""
        if rpc and self._client is not None and not (self._poison or self._server_lost):
            self._pong.clear()
            try:
                self._client.sendall(b"PING\n")
                self._pong.wait(5.0)
            except OSError:
                pass
        if self._poison or self._server_lost:
            raise GpuError(f"{call}: {self._poison or self._server_lost}")

    def misbehaviour(self, phase: str) -> str | None:
        if phase in ("quit", "eof"):
            return self._quit
        if phase == "ready":
            return self.startup if self.startup not in ("", "no-mps", "mps-lost", "ignore-quit") else None
        for m in self._modules.values():
            how = m.script.get(phase)
            if isinstance(how, str) and not how.startswith("error:"):
                return how
        return None

    # ---- the Gpu protocol ---------------------------------------------------------------
    def load(self, req: Load) -> Loaded:
        self._check("cuModuleLoadData", rpc=True)
        if req.module in self._modules:
            raise GpuError(f"module {req.module} is already loaded")
        script, example = _script_of(req, self._examples)
        if example is not None:
            log.warning(
                f"simulated GPU: {req.name} runs as the example {example!r}: the simulation does not run GPU code",
                program=req.name, module=req.module,
            )
        how = script.get("load")
        if isinstance(how, str) and how.startswith("error:"):
            raise GpuError(how[len("error:") :])
        # The blink premise, simulated: a load in one context waits for its kernels, queued ones too.
        with self._cv:
            self._cv.wait_for(lambda: not any(m.launched for m in self._modules.values()))
        time.sleep(float(script.get("load_ms", 0)) / 1e3)

        def num(k: str, d: int) -> int:
            v = script.get(k, d)
            return v if isinstance(v, int) else d

        queue, _ = self._streams.take()
        per_sm = num("per_sm", 8)
        self._modules[req.module] = _Module(req.module, req.name, script, req.threads, req.scratch, queue, per_sm)
        if script.get("quit") == "ignore":
            self._quit = "ignore"
        log.debug("simulated module", program=req.name, module=req.module, queue=queue)
        return Loaded(
            rt_abi=num("rt_abi", abi.RT_ABI),
            regs=num("regs", 32),
            per_sm=per_sm,
            local=num("local", 0),
            sms=num("sms", self.sms),
            dev=FAKE_DEV + (self.device << 32),
            scratch=req.scratch,
        )

    def payloads(self, module: int, path: str, layout: Layout) -> int:
        """The region mapped and "registered" at a simulated device address of its own; the kernels
        find it through their slot's words."""
        self._check("cuMemHostRegister")
        m = self._modules.get(module)
        if m is None:
            raise GpuError(f"module {module} is not loaded")
        return self._regions.map(module, m.name, path, layout)

    def launch(self, module: int, gen: int, slot: int, nodes: int, on_done: DoneCallback) -> None:
        self._check("cuLaunchKernel")
        m = self._modules.get(module)
        if m is None:
            raise GpuError(f"cuLaunchKernel: CUDA_ERROR_INVALID_HANDLE (module {module} is not loaded)")
        how = m.script.get("launch")
        if isinstance(how, str) and how.startswith("error:"):
            raise GpuError(how[len("error:") :])
        if not 0 <= slot < abi.SLOTS:
            raise GpuError(f"cuLaunchKernel: CUDA_ERROR_INVALID_VALUE (slot {slot})")
        if nodes < 1:
            raise GpuError(f"cuLaunchKernel: CUDA_ERROR_INVALID_VALUE (a grid of {nodes} blocks)")
        if m.per_sm < 1:
            raise GpuError(
                "cuLaunchKernel: CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES (too many resources requested for launch;"
                f" simulated: {m.name} reports {m.per_sm} blocks per SM)"
            )
        self._regions.launching(module, slot)  # its payload region in the slot's words, before the kernel reads them
        k = _Kernel(m, Fraction(nodes, m.per_sm * self.sms), nodes)
        with self._cv:
            m.launched += 1
            self._hw[m.queue].append(k)  # in launch order: its queue runs them in that order
        self._kernels(+1)  # on the GPU from here, as after cuLaunchKernel, even before LAUNCHED is written

        def run() -> None:
            ok, msg = True, ""
            try:
                if self._admit(k):
                    if m.script.get("start", True) is not False and m.script.get("kernel") not in RESIDENT:
                        self.mailbox.set_u32(slot, abi.STATE, abi.RUNNING)  # the resident examples write their own
                    ok, msg = self._kernel(k, slot)
                if self._poison:
                    ok, msg = False, self._poison
            finally:
                with self._cv:
                    m.launched -= 1
                    self._hw[m.queue].remove(k)
                    if k.started:
                        self._used -= k.share
                    self._cv.notify_all()
                self._kernels(-1)
                if self._server_lost:  # on the H200 a halted kernel's DONE never came (10 s)
                    log.warning("kernel ended; its completion is not seen, the MPS server is lost", program=m.name)
                else:
                    on_done(Done(module, gen, ok, msg))

        self._pending.append(threading.Thread(target=run, name=f"sim kernel {m.name}", daemon=True))

    def _admit(self, k: _Kernel) -> bool:
        """Wait until the kernel may start: first on its hardware queue, and its whole grid fits
        beside the running kernels.  False if the context is poisoned first (it never runs)."""
        q = self._hw[k.module.queue]
        with self._cv:
            self._cv.wait_for(lambda: self._poison or (q[0] is k and self._used + k.share <= 1))
            if self._poison:
                return False
            k.started = True
            self._used += k.share
            return True

    def _kernels(self, n: int) -> None:
        """Tell the stand-in server when this client starts and stops having a kernel on the GPU:
        on the H200 a client that exited with a kernel running faulted the device's other clients
        (docs/reliability.md), and the stand-in does the same."""
        with self._on_gpu_lock:
            self._on_gpu += n
            say = b"RUNNING\n" if n > 0 and self._on_gpu == 1 else b"IDLE\n" if self._on_gpu == 0 else b""
            if say and self._client is not None:
                with contextlib.suppress(OSError):  # the server is gone: the client is poisoned already
                    self._client.sendall(say)

    def launched(self) -> None:
        """After LAUNCHED is written: a kernel that kills its process must not race its reply."""
        pending, self._pending = self._pending, []
        for t in pending:
            t.start()

    def _kernel(self, k: _Kernel, slot: int) -> tuple[bool, str]:
        m = k.module
        kind = m.script.get("kernel", "sleep")
        mb = self.mailbox
        if kind in ("sleep", "fail"):
            time.sleep(float(m.script.get("ms", 0)) / 1e3)
            if kind == "fail":
                default = "CUDA_ERROR_LAUNCH_FAILED: unspecified launch failure (simulated)"
                msg = str(m.script.get("message", default))
                self._poisoned(msg)  # as on the H200: a kernel's error is sticky, its context's every kernel fails
                return False, msg
            return True, ""
        if kind == "hang":
            threading.Event().wait()
        if kind == "exit":
            os._exit(4)
        if kind == "fault":  # as examples/fault: after RUNNING, the illegal store, then EXITED (the store is posted)
            mb.set_u32(slot, abi.STATE, abi.EXITED)
            msg = "CUDA_ERROR_ILLEGAL_ADDRESS: an illegal memory access was encountered (simulated)"
            if self._client is not None:
                self._client.sendall(b"FAULT\n")  # the server tears every client down
            else:  # one context (blink): the error is sticky, every kernel of it fails with it
                self._poisoned(msg)
            return False, msg
        if kind == "spin":
            ms = mb.u32(slot, abi.USER_BASE) or 100
            end = time.monotonic() + ms / 1e3
            while time.monotonic() < end and not self._poison and mb.u32(slot, abi.CONTROL) != abi.HALT:
                time.sleep(0.001)
            if not self._poison:  # as examples/spin: EXITED as it returns
                mb.set_u32(slot, abi.STATE, abi.EXITED)
            return True, ""
        if kind in RESIDENT:
            resident(mb, slot, pause=m.script, poisoned=lambda: bool(self._poison),
                     start=m.script.get("start", True) is not False, turn=turn_of(kind, functools.partial(self._data.view, slot),
                                                           functools.partial(self._regions.view, m.id), k.nodes))
            return True, ""
        return False, f"simulated kernel {kind!r} is unknown"

    def stack_limit(self, set_to: int | None) -> int:
        self._check("cuCtxGetLimit")
        if set_to is not None:
            self._stack = set_to
        return self._stack

    def data(self, req: DataReq) -> int:
        self._check("cuMemAllocAsync")
        return self._data.place(req)

    def write(self, req: WriteReq) -> None:
        self._check("cuMemcpyHtoDAsync")
        self._data.write(req)

    def unload(self, module: int) -> None:
        m = self._modules.pop(module, None)
        if m is None:
            raise GpuError(f"cuModuleUnload: CUDA_ERROR_INVALID_HANDLE (module {module} is not loaded)")
        with self._cv:
            busy = m.launched
        if busy:
            self._modules[module] = m
            raise GpuError(f"cuModuleUnload: module {module} ({m.name}) still runs")
        self._streams.give(m.queue)
        self._regions.unmap(module)
        if m.script.get("quit") == "ignore" and self.startup != "ignore-quit":
            self._quit = None

    def close(self) -> None:
        self._data.close()
        if self._client is not None:
            self._client.close()
            self._client = None
