"""The simulated GPU (``--gpu sim``): kernels that run on the CPU, for tests.

Chosen only by that flag, never as a fallback.  It exercises every path of
the supervisor on a machine with no GPU: "context creation" connects to the
stand-in MPS daemon (so the client lists are real), kernels are threads that
read and write the real mailbox, and a script in the image makes the worker
finish, fail, hang, die or break the protocol where a test wants it.

The image ("cubin") is either a script, ``MESHSIM1`` then a JSON object, or a
real cubin (an ELF from nvJitLink), which runs as the example program its
name starts with (heartbeat, echo, spin, fault), else returns at once.

Script keys (all optional):
  kernel: sleep | fail | hang | exit | heartbeat | echo | spin | fault
  ms: run time of sleep/fail (default 0); message: fail's error text
  load, launch, ready: a protocol fault in that reply: hang | exit | garbage |
      wrong-op | short | close-stdout | unsolicited | error:<text>
  quit: ignore  (ignore QUIT and stdin EOF)
  load_ms: delay before LOADED; rt_abi, regs, local, per_sm, sms: reported values
Startup faults come from MESHD_MPS_SIM_STARTUP (same values as ``ready``, plus
``no-mps``: do not connect to the daemon, like a worker with another pipe dir).

Several GPUs: ``--device N`` of ``$MESHD_MPS_SIM_GPUS`` (default 1; another
ordinal is refused as cuDeviceGet refuses it); the worker tells the stand-in
daemon its device (``HELLO <pid> <device>``), which counts clients and tears
them down per device, and its mailbox's "device address" differs per GPU.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from dataclasses import dataclass, field

import structlog

from meshd_mps import abi
from meshd_mps.frames import Done, Load, Loaded
from meshd_mps.mailbox import Mailbox

from .gpu import DoneCallback, GpuError

log = structlog.get_logger("meshd_mps.worker")

MAGIC = b"MESHSIM1"
SIM_SMS = 132
FAKE_DEV = 0x7F00_0000_0000  # a recognisable "device address" of the mailbox
STARTUP_ENV = "MESHD_MPS_SIM_STARTUP"
#: What the H200's driver said to an idle client's call once its control daemon was killed.
RPC_FAILURE = "CUDA_ERROR_MPS_RPC_FAILURE (the remote procedural call between the MPS server and the MPS client failed; simulated)"


@dataclass
class _Module:
    name: str
    script: dict[str, object]
    threads: int
    scratch: int
    running: threading.Event = field(default_factory=threading.Event)


def _script_of(req: Load) -> dict[str, object]:
    if req.cubin.startswith(MAGIC):
        try:
            s = json.loads(req.cubin[len(MAGIC) :])
        except ValueError as e:
            raise GpuError(f"cuModuleLoadData: CUDA_ERROR_INVALID_IMAGE (simulated: bad script: {e})") from None
        if not isinstance(s, dict):
            raise GpuError("cuModuleLoadData: CUDA_ERROR_INVALID_IMAGE (simulated: script is not an object)")
        return s
    if not req.cubin.startswith(b"\x7fELF"):
        raise GpuError("cuModuleLoadData: CUDA_ERROR_INVALID_IMAGE (device kernel image is invalid)")
    for kind in ("heartbeat", "echo", "spin", "fault"):
        if req.name.startswith(kind):
            return {"kernel": kind}
    return {"kernel": "sleep", "ms": 0}


class SimGpu:
    def __init__(self, mailbox: Mailbox, sms: int, device: int = 0):
        from meshd_mps.device import simulated_count

        self.mailbox = mailbox
        self.startup = os.environ.get(STARTUP_ENV, "")
        try:
            n = simulated_count()
        except Exception as e:  # ConfigError: a bad MESHD_MPS_SIM_GPUS
            raise GpuError(f"cuInit: CUDA_ERROR_NO_DEVICE (simulated: {e})") from None
        if not 0 <= device < n:
            raise GpuError(f"cuDeviceGet: CUDA_ERROR_INVALID_DEVICE (simulated: device {device}; {n} GPUs, 0-{n - 1})")
        self.device = device
        if sms < 0 or sms > SIM_SMS:
            raise GpuError(f"cuDevSmResourceSplitByCount: CUDA_ERROR_INVALID_RESOURCE_CONFIGURATION ({sms} of {SIM_SMS} SMs)")
        self.sms = -(-sms // 8) * 8 if sms else SIM_SMS  # green contexts come in multiples of 8 SMs
        self._client: socket.socket | None = None
        self._modules: dict[int, _Module] = {}
        self._pending: list[threading.Thread] = []
        self._stack = 1024  # the driver's default stack limit, bytes per thread
        self._quit = "ignore" if self.startup == "ignore-quit" else None
        self._poison: str | None = None  # a sticky error: every later call fails with it
        self._server_lost: str | None = None  # calls fail with it; running kernels go on, unreported
        self._on_gpu = 0  # kernels launched and not yet ended (the stand-in server is told 0 <-> 1)
        self._on_gpu_lock = threading.Lock()
        self._pong = threading.Event()
        self._connect()
        if self._client is not None:
            threading.Thread(target=self._listen, args=(self._client,), name="sim mps client", daemon=True).start()

    def _connect(self) -> None:
        from meshd_mps.standin import StandinRefused, connect_client

        if self.startup == "no-mps":
            return
        pipe = os.environ.get("CUDA_MPS_PIPE_DIRECTORY", "/tmp/nvidia-mps")
        try:
            self._client = connect_client(pipe, os.getpid(), device=self.device)
        except StandinRefused as e:
            raise GpuError(f"cuCtxCreate: CUDA_ERROR_MPS_MAX_CLIENTS_REACHED ({e})") from None
        except OSError as e:
            raise GpuError(f"cuCtxCreate: CUDA_ERROR_MPS_CONNECTION_FAILED ({e})") from None
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
                    self._poison = "CUDA_ERROR_ILLEGAL_ADDRESS: an illegal memory access was encountered (simulated)"
                elif line == b"TERMINATED":
                    self._poison = "CUDA_ERROR_MPS_CLIENT_TERMINATED: the MPS client has been terminated by the server (simulated)"
                elif line == b"PONG":
                    self._pong.set()

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
            return self.startup if self.startup not in ("", "no-mps", "ignore-quit") else None
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
        script = _script_of(req)
        how = script.get("load")
        if isinstance(how, str) and how.startswith("error:"):
            raise GpuError(how[len("error:") :])
        # The blink premise, simulated: a load in one context waits for its running kernels.
        for m in self._modules.values():
            while m.running.is_set():
                time.sleep(0.001)
        time.sleep(float(script.get("load_ms", 0)) / 1e3)  # type: ignore[arg-type]
        self._modules[req.module] = _Module(req.name, script, req.threads, req.scratch)
        if script.get("quit") == "ignore":
            self._quit = "ignore"

        def num(k: str, d: int) -> int:
            v = script.get(k, d)
            return v if isinstance(v, int) else d

        return Loaded(
            rt_abi=num("rt_abi", abi.RT_ABI),
            regs=num("regs", 32),
            per_sm=num("per_sm", 8),
            local=num("local", 0),
            sms=num("sms", self.sms),
            dev=FAKE_DEV + (self.device << 32),
            scratch=req.scratch,
        )

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
        m.running.set()
        self._kernels(+1)  # on the GPU from here, as after cuLaunchKernel, even before LAUNCHED is written

        def run() -> None:
            ok, msg = True, ""
            try:
                ok, msg = self._kernel(m, slot)
                if self._poison:
                    ok, msg = False, self._poison
            finally:
                m.running.clear()
                self._kernels(-1)
                if self._server_lost:  # on the H200 a halted kernel's DONE never came (10 s)
                    log.warning("kernel ended; its completion is not seen, the MPS server is lost", program=m.name)
                else:
                    on_done(Done(module, gen, ok, msg))

        self._pending.append(threading.Thread(target=run, name=f"sim kernel {m.name}", daemon=True))

    def _kernels(self, n: int) -> None:
        """Tell the stand-in server when this client starts and stops having a kernel on the GPU:
        on the H200 a client that exited with a kernel running faulted the device's other clients
        (docs/reliability.md), and the stand-in does the same."""
        with self._on_gpu_lock:
            self._on_gpu += n
            say = b"RUNNING\n" if n > 0 and self._on_gpu == 1 else b"IDLE\n" if self._on_gpu == 0 else b""
            if say and self._client is not None:
                try:
                    self._client.sendall(say)
                except OSError:
                    pass  # the server is gone: the client is poisoned already

    def launched(self) -> None:
        """After LAUNCHED is written: a kernel that kills its process must not race its reply."""
        pending, self._pending = self._pending, []
        for t in pending:
            t.start()

    def _kernel(self, m: _Module, slot: int) -> tuple[bool, str]:
        kind = m.script.get("kernel", "sleep")
        mb = self.mailbox
        if kind in ("sleep", "fail"):
            time.sleep(float(m.script.get("ms", 0)) / 1e3)  # type: ignore[arg-type]
            if kind == "fail":
                return False, str(m.script.get("message", "CUDA_ERROR_LAUNCH_FAILED: unspecified launch failure (simulated)"))
            return True, ""
        if kind == "hang":
            threading.Event().wait()
        if kind == "exit":
            os._exit(4)
        if kind == "fault":  # as examples/fault: RUNNING, the illegal store, EXITED (the store is posted)
            mb.set_u32(slot, abi.STATE, abi.RUNNING)
            mb.set_u32(slot, abi.STATE, abi.EXITED)
            if self._client is not None:
                self._client.sendall(b"FAULT\n")  # the server tears every client down
            return False, "CUDA_ERROR_ILLEGAL_ADDRESS: an illegal memory access was encountered (simulated)"
        if kind == "spin":
            ms = mb.u32(slot, abi.USER_BASE) or 100
            end = time.monotonic() + ms / 1e3
            while time.monotonic() < end and not self._poison and mb.u32(slot, abi.CONTROL) != abi.HALT:
                time.sleep(0.001)
            return True, ""
        if kind in ("heartbeat", "echo"):
            self._resident(slot, echo=kind == "echo")
            return True, ""
        return False, f"simulated kernel {kind!r} is unknown"

    def _resident(self, slot: int, echo: bool) -> None:
        """A resident program: beat (and serve the ring) until the host writes HALT."""
        mb = self.mailbox
        mb.set_u32(slot, abi.STATE, abi.RUNNING)
        last = time.monotonic_ns()
        gap = 0
        while mb.u32(slot, abi.CONTROL) != abi.HALT and not self._poison:
            now = time.monotonic_ns()
            if mb.u32(slot, abi.GAP_RESET):
                gap = 0
                mb.set_u32(slot, abi.GAP_RESET, 0)
            else:
                gap = max(gap, now - last)
            last = now
            mb.set_u64(slot, abi.HEARTBEAT, (mb.u64(slot, abi.HEARTBEAT) + 1) & (2**64 - 1))
            mb.set_u64(slot, abi.BEAT_TIME, now)
            mb.set_u64(slot, abi.MAX_GAP, gap)
            if echo:
                self._serve_ring(slot)
            time.sleep(0.0005)
        if not self._poison:  # a kernel torn down by the server never gets to say EXITED
            mb.set_u32(slot, abi.STATE, abi.EXITED)

    def _serve_ring(self, slot: int) -> None:
        mb = self.mailbox
        while True:
            resp = mb.u32(slot, abi.RESP_HEAD)
            if resp == mb.u32(slot, abi.REQ_HEAD):
                return
            i = resp % abi.RING
            req_at = slot * abi.SLOT_BYTES + abi.REQ_BASE + i * abi.ENTRY_BYTES
            resp_at = slot * abi.SLOT_BYTES + abi.RESP_BASE + i * abi.ENTRY_BYTES
            mb.mm[resp_at : resp_at + abi.ENTRY_BYTES] = mb.mm[req_at : req_at + abi.ENTRY_BYTES]
            mb.set_u32(slot, abi.RESP_HEAD, (resp + 1) & 0xFFFFFFFF)

    def stack_limit(self, set_to: int | None) -> int:
        self._check("cuCtxGetLimit")
        if set_to is not None:
            self._stack = set_to
        return self._stack

    def unload(self, module: int) -> None:
        m = self._modules.pop(module, None)
        if m is None:
            raise GpuError(f"cuModuleUnload: CUDA_ERROR_INVALID_HANDLE (module {module} is not loaded)")
        if m.running.is_set():
            self._modules[module] = m
            raise GpuError(f"cuModuleUnload: module {module} ({m.name}) still runs")
        if m.script.get("quit") == "ignore" and self.startup != "ignore-quit":
            self._quit = None

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None
