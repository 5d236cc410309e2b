"""What the H200 does to resident kernels, in the simulated GPU: hardware work queues, the whole
grid resident at once, STATE = RUNNING at start, and images refused in the driver's words.

The sim worker is driven directly over its pipes (``python -m meshd_mps worker --gpu sim``),
frame by frame (tests/rigs/worker.py, the GPU tests' rig too), with a mailbox of the test's own;
no supervisor, no MPS daemon (the worker's CUDA_MPS_PIPE_DIRECTORY is an empty directory, so its
context is a plain one).  A kernel that must *not* start is checked while the others beat a given
number of times more: the wait is on their progress, never a fixed sleep.  Modules are loaded
before anything is launched: in one context a module load waits for every kernel (the blink
premise, simulated too).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from contextlib import ExitStack

import pytest

from meshd_mps.gpu.compiler import cuda_to_ptx, image_hash, ptx_to_cubin
from meshd_mps.gpu.examples import cubin_id
from meshd_mps.protocol import abi, frames
from meshd_mps.protocol.frames import LaunchReq, Load, Op
from meshd_mps.protocol.mailbox import Mailbox
from workers import warm
from workers.gpu import GpuError, Streams
from workers.main import parse_args
from workers.warm import QUEUES_ENV

from ..rigs.sim import sim
from ..rigs.waits import poll
from ..rigs.worker import ROOT, Worker

pytestmark = pytest.mark.timeout(60)

#: What the H200's driver says for a cubin without the entry (cuGetErrorString of CUDA_ERROR_NOT_FOUND).
DRIVER_NO_ENTRY = "cuModuleGetFunction(mesh_main): CUDA_ERROR_NOT_FOUND (named symbol not found)"
HEARTBEAT = sim(kernel="heartbeat")


def image(module: int, cubin: bytes = HEARTBEAT, name: str = "prog", tag: int = 0) -> Load:
    """A LOAD of one warp, no shared memory, no scratch; ``tag``: the image hash, as the daemon sends it."""
    return Load(module, 32, 0, 0, name, cubin, tag)


@pytest.fixture
def mailbox():
    mb = Mailbox.create()
    yield mb
    mb.close()


@pytest.fixture
def worker(mailbox):
    """worker(*args): a sim worker on the test's mailbox, its JSON logs read; every one is halted
    and quit afterwards."""
    env = {k: v for k, v in os.environ.items()
           if k not in (QUEUES_ENV, "MESHD_MPS_SIM_STARTUP", "MESHD_MPS_WORKER_INJECT")}
    with tempfile.TemporaryDirectory(prefix="meshd-nompsd-") as pipe_dir, ExitStack() as made:
        env.update(CUDA_MPS_PIPE_DIRECTORY=pipe_dir, MESHD_MPS_LOG_LEVEL="debug")

        def start(*args: str, **more_env: str) -> Worker:
            w = Worker(mailbox, "sim", *args, env=env | more_env, logs=True, reply_within=20)
            made.callback(w.close)
            return w

        yield start
        for s in range(64):
            mailbox.halt(s)


def states(mb: Mailbox, slots) -> list[int]:
    return [mb.u32(s, abi.STATE) for s in slots]


def running(mb: Mailbox, slots, what: str) -> None:
    poll(lambda: all(st == abi.RUNNING for st in states(mb, slots)), 20,
         f"{what}: STATE = RUNNING in slots {list(slots)}")


def beat_meanwhile(mb: Mailbox, slots, beats: int = 100) -> None:
    """Until every one of ``slots`` has beaten ``beats`` times more: time in which a kernel that may
    start has started (the simulation starts one within a millisecond)."""
    start = {s: mb.heartbeat(s) for s in slots}
    poll(lambda: all(mb.heartbeat(s) >= start[s] + beats for s in slots), 30,
         f"{beats} more beats in slots {list(slots)}")


# ---- the stream allocation both GPUs share -----------------------------------------------------

def test_streams_give_the_lowest_free_queue_and_name_the_limit():
    s = Streams(list("ABCDEFGH"))
    assert [s.take() for _ in range(8)] == list(enumerate("ABCDEFGH"))
    full = r"^cuStreamCreate: all 8 hardware work queues of this context hold a module;"
    with pytest.raises(GpuError, match=full) as e:
        s.take()
    assert not e.value.refused  # the GPU is full; the image is fine
    s.give(5)
    s.give(2)
    assert s.take() == (2, "C") and s.take() == (5, "F")


# ---- hardware work queues ----------------------------------------------------------------------

@pytest.mark.parametrize("args, n", [((), 8), (("--queues", "32"), 32)], ids=["default", "queues-32"])
def test_one_queue_per_resident_kernel(worker, mailbox, args, n):
    """n resident kernels run at once; the (n+1)th module finds no queue of its own, and an (n+1)th
    resident kernel on a held queue starts only once the kernel holding it has ended."""
    w = worker(*args)
    for i in range(n):
        w.load(image(i + 1, name=f"hb{i}"))
    text = w.load_error(image(n + 1, HEARTBEAT, f"hb{n}"), frames.FAILED)
    assert text.startswith(f"cuStreamCreate: all {n} hardware work queues of this context hold a module;"), text
    for i in range(n):
        w.launch(i + 1, 1, slot=i)
    running(mailbox, range(n), f"{n} heartbeats")
    w.launch(1, 2, slot=n)  # on module 1's queue, which its first kernel holds
    beat_meanwhile(mailbox, range(n), beats=100 if n <= 8 else 30)
    assert mailbox.u32(n, abi.STATE) == abi.IDLE, "a kernel started on a queue that a resident kernel holds"
    assert (1, 2) not in w.dones
    mailbox.halt(0)
    assert w.done(1, 1).ok
    running(mailbox, [n], "the kernel queued behind the halted one")
    assert states(mailbox, range(1, n)) == [abi.RUNNING] * (n - 1)


def test_queues_stay_distinct_through_churn(worker, mailbox):
    """Load A..H, unload C, load J, as blink mode does it (every program halted for the module
    change, then relaunched): J gets C's queue, the lowest free one, and runs beside the other
    seven (a queue handed out by creation order would be the 9th, A's, and J would never start)."""
    w = worker()
    for i, name in enumerate("ABCDEFGH"):
        w.load(image(i + 1, name=name))
    for i in range(8):
        w.launch(i + 1, 1, slot=i)
    running(mailbox, range(8), "A..H")
    for s in range(8):
        mailbox.halt(s)
    assert all(w.done(i + 1, 1).ok for i in range(8))
    w.unload(3)
    w.load(image(10, name="J"))
    assert w.logged(msg="simulated module", program="J")["queue"] == 2
    others = [0, 1, 3, 4, 5, 6, 7]
    for s in others:
        mailbox.run(s)
        w.launch(s + 1, 2, slot=s)
    w.launch(10, 1, slot=9)
    running(mailbox, [*others, 9], "J beside A, B, D..H")
    beat_meanwhile(mailbox, [*others, 9], beats=20)
    assert states(mailbox, [*others, 9]) == [abi.RUNNING] * 8


# ---- co-residency ------------------------------------------------------------------------------

def test_a_grid_waits_until_all_of_it_fits(worker, mailbox):
    """On 8 SMs: A (2 blocks per SM, 10 blocks: 5/8 of the context) and C (1 per SM, 3 blocks:
    3/8) fill it exactly and run; B (1 per SM, 8 blocks: all of it) waits while either runs, and
    runs alone."""
    w = worker("--sms", "8")
    assert w.load(image(1, sim(kernel="heartbeat", per_sm=2), "A")).sms == 8
    w.load(image(2, sim(kernel="heartbeat", per_sm=1), "C"))
    w.load(image(3, sim(kernel="heartbeat", per_sm=1), "B"))
    w.launch(1, 1, slot=0, nodes=10)
    w.launch(2, 1, slot=1, nodes=3)
    running(mailbox, [0, 1], "A and C, which fill the context exactly")
    w.launch(3, 1, slot=2, nodes=8)
    beat_meanwhile(mailbox, [0, 1])
    assert mailbox.u32(2, abi.STATE) == abi.IDLE, "B started beside A and C"
    mailbox.halt(0)
    assert w.done(1, 1).ok
    beat_meanwhile(mailbox, [1])
    assert mailbox.u32(2, abi.STATE) == abi.IDLE, "B started beside C"
    mailbox.halt(1)
    assert w.done(2, 1).ok
    running(mailbox, [2], "B alone")


# ---- STATE = RUNNING at start ------------------------------------------------------------------

def test_every_kind_writes_running_at_start_unless_told_not_to(worker, mailbox):
    w = worker()
    mailbox.set_u32(2, abi.USER_BASE, 10_000)  # spin's run time, ms: it runs until halted
    # (fail is not among them: its error is sticky, and would end the others; see the next test)
    kinds = [sim(kernel="sleep"), sim(kernel="sleep", ms=1), sim(kernel="spin"), sim(kernel="hang"), HEARTBEAT,
             sim(kernel="echo")]
    kinds += [sim(kernel="sleep", start=False), sim(kernel="heartbeat", start=False)]
    for i, cubin in enumerate(kinds):
        w.load(image(i + 1, cubin))
    for i in range(6):
        w.launch(i + 1, 1, slot=i)
    running(mailbox, range(6), "sleep, sleep 1 ms, spin, hang, heartbeat, echo")
    assert w.done(1, 1).ok and w.done(2, 1).ok  # the sleeps ended, having started
    w.launch(7, 1, slot=6)
    assert w.done(7, 1).ok
    w.launch(8, 1, slot=7)
    poll(lambda: mailbox.heartbeat(7) > 20, 10, "the start-less heartbeat beating")
    assert states(mailbox, [6, 7]) == [abi.IDLE, abi.IDLE]
    mailbox.halt(7)
    assert w.done(8, 1).ok and mailbox.u32(7, abi.STATE) == abi.EXITED  # otherwise as its kind


def test_a_failing_kernel_poisons_its_context(worker, mailbox):
    """As on the H200 (blink mode): a kernel's error is sticky, so every kernel of the context ends
    with it, a resident one never says EXITED, and every later launch fails."""
    w = worker()
    w.load(image(1, HEARTBEAT))
    w.load(image(2, sim(kernel="fail", ms=50, message="CUDA_ERROR_ILLEGAL_ADDRESS: boom")))
    w.launch(1, 1, slot=0)
    poll(lambda: mailbox.heartbeat(0) > 5, 10, "the heartbeat beating")
    w.launch(2, 1, slot=1)
    assert not w.done(2, 1).ok
    d = w.done(1, 1)
    assert not d.ok and d.message == "CUDA_ERROR_ILLEGAL_ADDRESS: boom"
    assert mailbox.u32(0, abi.STATE) == abi.RUNNING  # torn down, not ended
    ok, payload = w.ask(Op.LAUNCH, LaunchReq(1, 2, 0, 1).encode(), Op.LAUNCHED)
    assert not ok and "CUDA_ERROR_ILLEGAL_ADDRESS: boom" in frames.reply_text(payload)


def test_exit_writes_running_before_it_exits(worker, mailbox):
    w = worker()
    w.load(image(1, sim(kernel="exit")))
    w.launch(1, 1, slot=0)
    assert w.p.wait(timeout=10) == 4
    assert mailbox.u32(0, abi.STATE) == abi.RUNNING


# ---- images: what the simulation runs, and refusals --------------------------------------------

@pytest.fixture(scope="module")
def cubins() -> dict[str, tuple[bytes, int]]:
    """The heartbeat example as a real cubin (as a one-warp load compiles it: at most 248 registers),
    the same code at another register cap (another cubin: not the example's), and the same without
    its entry (renamed in the PTX), each with its image hash (LOAD's tag: what the user knows it by;
    the simulation knows an example by the cubin)."""
    d = ROOT / "examples" / "heartbeat"
    ptx = cuda_to_ptx((d / "heartbeat.cu").read_bytes(), "heartbeat", include=[str(ROOT / "examples" / "include")])
    other = ptx.replace(b"mesh_main", b"mesh_other")
    return {"heartbeat": (ptx_to_cubin(ptx, "sm_90", 248), image_hash(ptx, 0)),
            "capped": (ptx_to_cubin(ptx, "sm_90", 64), image_hash(ptx, 0)),
            "no-entry": (ptx_to_cubin(other, "sm_90", 248), image_hash(other, 0))}


def test_an_example_cubin_runs_as_the_example_and_says_so(worker, mailbox, cubins):
    w = worker()
    cubin, _tag = cubins["heartbeat"]
    w.load(image(1, cubin, "heartbeat-7", 0))  # known by the cubin: LOAD's tag (the PTX's hash) plays no part
    w.logged(level="warning",
             msg="simulated GPU: heartbeat-7 runs as the example 'heartbeat': the simulation does not run GPU code")
    w.launch(1, 1, slot=0)
    poll(lambda: mailbox.heartbeat(0) > 5, 10, "the example beating")


def test_images_the_simulation_cannot_run_are_refused(worker, cubins):
    w = worker()
    cubin, tag = cubins["capped"]  # heartbeat's code and tag, compiled for another manifest's register cap
    text = w.load_error(image(1, cubin, "mything", tag), frames.REFUSED)
    # The two words check, load and ps use: the PTX's hash, and the cubin the simulation compared.
    assert text.startswith(f"simulated GPU: mything (hash {tag:016x}, cubin {cubin_id(cubin):016x}) is not one of"
                           " the shipped examples"), text
    cubin, tag = cubins["no-entry"]
    assert w.load_error(image(2, cubin, "heartbeat", tag), frames.NO_ENTRY) == DRIVER_NO_ENTRY
    assert w.load_error(image(3, sim(kernel="heartbeat", entry=False)), frames.NO_ENTRY) == DRIVER_NO_ENTRY
    text = w.load_error(image(4, b"\x00not an image"), frames.REFUSED)
    assert text.startswith("cuModuleLoadData: CUDA_ERROR_INVALID_IMAGE"), text
    text = w.load_error(image(5, b"MESHSIM1{not json"), frames.REFUSED)
    assert "bad script" in text, text
    # A failure that is not the image's stays a plain one (ok word 0); the worker serves on.
    oom = image(6, sim(load="error:CUDA_ERROR_OUT_OF_MEMORY: out of memory"))
    assert w.load_error(oom, frames.FAILED) == "CUDA_ERROR_OUT_OF_MEMORY: out of memory"
    w.load(image(7))


def test_the_examples_known_are_the_daemons(worker, mailbox, cubins):
    """A sim worker knows the cubins the daemon names on its command line (``--examples``, written
    by worker_argv once per daemon), not others of its own: told heartbeat's cubin is another, it
    refuses the real one; told it is this one, it runs it, whatever the name and tag."""
    from meshd_mps.gpu.device import simulated_device
    from meshd_mps.gpu.examples import example_images
    from meshd_mps.supervision.argv import worker_argv
    from workers.sim_images import parse

    argv = worker_argv("/proc/self/fd/3", 0, "sim")
    assert parse(argv[argv.index("--examples") + 1]) == example_images(simulated_device())
    assert "--examples" not in worker_argv("/proc/self/fd/3", 0, "cuda")
    cubin, tag = cubins["heartbeat"]
    c = cubin_id(cubin)
    w = worker("--examples", f"heartbeat={c ^ 1:016x}")
    text = w.load_error(image(1, cubin, "heartbeat", tag), frames.REFUSED)
    assert f"(the examples' cubins: heartbeat {c ^ 1:016x})" in text, text
    w.close()
    w = worker("--examples", f"heartbeat={c:016x}")
    w.load(image(2, cubin, "anything", tag ^ 1))
    w.launch(2, 1, slot=0)
    poll(lambda: mailbox.heartbeat(0) > 5, 10, "the example beating")


def test_cuda_refusals_are_by_error_code():
    cu = pytest.importorskip("cuda.bindings.driver")
    from workers.cuda_gpu import IMAGE_ERRORS, NO_ENTRY, check

    R = cu.CUresult
    for code in (R.CUDA_ERROR_INVALID_IMAGE, R.CUDA_ERROR_INVALID_PTX, R.CUDA_ERROR_NO_BINARY_FOR_GPU,
                 R.CUDA_ERROR_UNSUPPORTED_PTX_VERSION, R.CUDA_ERROR_INVALID_SOURCE):
        with pytest.raises(GpuError, match=f"^cuModuleLoadData: {code.name}") as e:
            check((code, None), "cuModuleLoadData", IMAGE_ERRORS)
        assert e.value.refused, code
    with pytest.raises(GpuError) as e:
        check((R.CUDA_ERROR_OUT_OF_MEMORY, None), "cuModuleLoadData", IMAGE_ERRORS)
    assert not e.value.refused
    with pytest.raises(GpuError, match=r"^cuModuleGetFunction\(mesh_main\): CUDA_ERROR_NOT_FOUND") as e:
        check((R.CUDA_ERROR_NOT_FOUND, None), "cuModuleGetFunction(mesh_main)", NO_ENTRY, frames.NO_ENTRY)
    assert e.value.refused and e.value.word == frames.NO_ENTRY
    with pytest.raises(GpuError) as e:
        check(R.CUDA_ERROR_NOT_FOUND, "cuModuleGetGlobal(x)")
    assert not e.value.refused


# ---- --queues ----------------------------------------------------------------------------------

@pytest.mark.parametrize("value", ["33", "-1", "eight"])
def test_queues_out_of_range_is_refused(mailbox, value):
    r = subprocess.run([sys.executable, "-m", "meshd_mps", "worker", "--mailbox", mailbox.path, "--gpu", "sim",
                        "--queues", value], cwd=ROOT, capture_output=True, text=True, timeout=30,
                       pass_fds=(mailbox.fd,))
    assert r.returncode == 2, r
    assert "argument --queues: " in r.stderr, r.stderr
    if value == "33":
        assert "the driver takes at most 32 hardware work queues (CUDA_DEVICE_MAX_CONNECTIONS)" in r.stderr, r.stderr


def test_warm_reads_queues_as_argparse_does():
    argvs = [["--mailbox", "m"], ["--mailbox", "m", "--queues", "32"], ["--mailbox", "m", "--queues=2"],
             ["--mailbox", "m", "--queues", "8", "--queues", "0"], ["--mailbox", "m", "--gpu", "sim", "--queues", "1"]]
    for argv in argvs:
        assert warm.queues(argv) == parse_args(argv).queues, argv
    with pytest.raises(SystemExit):  # no abbreviations, which warm.py would not read
        parse_args(["--mailbox", "m", "--queue", "4"])


def test_warm_sets_the_variable_before_its_cuinit(monkeypatch):
    seen = []

    class Fake:
        def __init__(self, sms: int, device: int, hold: bool = False):
            seen.append(os.environ.get(QUEUES_ENV))  # what its thread's cuInit would read

        def take(self):
            return self

    monkeypatch.setattr(warm, "Warm", Fake)
    monkeypatch.setenv(QUEUES_ENV, "5")  # inherited: kept by --queues 0, restored after the test
    warm.start(["--mailbox", "m", "--gpu", "cuda"])
    warm.start(["--mailbox", "m", "--gpu", "cuda", "--queues", "32"])
    assert seen == ["5", "32"]
    assert isinstance(warm.take(), Fake)
    warm.start(["--mailbox", "m", "--gpu", "cuda", "--queues", "33"])  # argparse refuses it next: nothing warmed
    assert seen == ["5", "32"] and warm.take() is None and os.environ[QUEUES_ENV] == "32"


def test_the_driver_reads_the_variable_clamped():
    assert warm.driver_queues({}) == warm.DEFAULT_QUEUES == 8
    assert [warm.driver_queues({QUEUES_ENV: v}) for v in ("32", "100", "0", "4", "x", "")] == [32, 32, 1, 4, 8, 8]


def _not_shared_memory_dir() -> str | None:
    """A directory of ours on a filesystem that is not tmpfs (the repository's, or home), if any."""
    from workers.hostmem import TMPFS_MAGIC

    for d in (str(ROOT), os.path.expanduser("~")):
        if os.access(d, os.W_OK) and subprocess.run(["stat", "-f", "-c", "%t", d], capture_output=True,
                                                    text=True).stdout.strip() != f"{TMPFS_MAGIC:x}":
            return d
    return None


def test_a_payload_region_is_mapped_only_as_the_driver_would_register_it(monkeypatch):
    """PAYLOADS on the simulated GPU: a region off shared memory refused as the H200 refuses it, one
    of another size or owner refused by its mapping, one that fits given a device address of its own."""
    from meshd_mps.protocol.payloads import Layout, Region
    from workers.sim_gpu import SimGpu

    monkeypatch.setenv("MESHD_MPS_SIM_STARTUP", "no-mps")  # a plain context: no MPS daemon to join
    lay = Layout(4096, 4096)
    mb, good = Mailbox.create(), Region.create(lay)
    gpu = SimGpu(mb, 0)
    try:
        gpu.load(Load(1, 32, 0, 0, "p", sim(kernel="sleep")))
        with pytest.raises(GpuError, match="expected"):
            gpu.payloads(1, good.path, Layout(8192, 8192))  # not the size its layout says
        if (d := _not_shared_memory_dir()) is not None:
            fd, path = tempfile.mkstemp(dir=d, prefix=".meshd-region-test.")
            try:
                os.ftruncate(fd, lay.size)
                with pytest.raises(GpuError, match="cuMemHostRegister: CUDA_ERROR_INVALID_VALUE"):
                    gpu.payloads(1, path, lay)
            finally:
                os.close(fd)
                os.unlink(path)
        dev = gpu.payloads(1, good.path, lay)
        assert dev != 0 and dev != mb.address
        with pytest.raises(GpuError, match="has a payload region already"):
            gpu.payloads(1, good.path, lay)
        gpu.unload(1)
    finally:
        gpu.close()
        good.close()
        mb.close()


def test_a_mailbox_that_is_not_shared_memory_is_refused_as_on_the_h200():
    """cuMemHostRegister of a regular file's pages: CUDA_ERROR_INVALID_VALUE on the H200
   ; a memfd's and /dev/shm's pages are taken."""
    from workers.sim_gpu import SimGpu

    d = _not_shared_memory_dir()
    if d is None:
        pytest.skip("no writable directory off tmpfs to put a mailbox file in")
    fd, path = tempfile.mkstemp(dir=d, prefix=".meshd-mailbox-test.")
    os.close(fd)
    try:
        mb = Mailbox.create(path)
        try:
            with pytest.raises(GpuError, match="cuMemHostRegister: CUDA_ERROR_INVALID_VALUE"):
                SimGpu(mb, 0)
        finally:
            mb.close()
    finally:
        os.unlink(path)
    with ExitStack() as stack:
        for mb in (Mailbox.create(), Mailbox.create(f"/dev/shm/meshd-mps-test.{os.getpid()}.mailbox")):
            stack.callback(mb.close)
            if mb.path.startswith("/dev/shm/"):
                stack.callback(os.unlink, mb.path)
            stack.callback(SimGpu(mb, 0).close)


def test_a_failed_mps_connection_leaves_the_frame_pipes_alone(worker):
    """On the H200 a worker whose MPS server was shutting down found fd 0 closed after the driver's
    failed connect, and its next read raised EBADF: a traceback, and no answer.  The
    simulated connect does the same (``mps-lost``); the frames are on pipes of the worker's own
    (workers/pipes.py), so every request is answered with the driver's error, and QUIT ends it
    with status 0 and nothing on stderr but its JSON log."""
    w = worker(MESHD_MPS_SIM_STARTUP="mps-lost")
    ok, payload = w.ask(Op.READY, b"", Op.READY)
    assert not ok and "CUDA_ERROR_MPS_CONNECTION_FAILED" in frames.reply_text(payload)
    ok, payload = w.ask(Op.LOAD, image(0).encode(), Op.LOADED)
    assert not ok and "CUDA_ERROR_MPS_CONNECTION_FAILED" in frames.reply_text(payload)
    w.send(Op.QUIT)
    assert w.p.wait(20) == 0
    w.logged(msg="GPU not opened")
    assert all("level" in e for e in w.logs), [e for e in w.logs if "level" not in e]
