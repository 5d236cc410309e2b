"""The worker frame protocol, shared by the supervisor and the worker process.

A frame is ``u32 little-endian length`` of what follows, ``u8 op``, then the
body; the length counts the op byte, so it is at least 1 and at most
``MAX_FRAME``.  docs/protocol.md describes every op and body byte by byte;
this module is the only implementation of it, on both sides.
"""

from __future__ import annotations

import enum
import os
import struct
from dataclasses import dataclass

from meshd_mps.base.errors import (
    FrameError as FrameError,  # re-exported: the frame code's callers catch it here
    ImageRefused,
)
from meshd_mps.protocol.abi import ENTRY

HEADER = struct.Struct("<I")
#: The frame protocol's version, sent in HELLO.  Bumped at any change of a frame's layout or meaning
#: (1: the ops below, HELLO included; 2: LOAD carries the program's tag, HELLO each module's tag and
#: LOADED report, so that a daemon that did not load a module can adopt it; 3: LOADED's ok word 3,
#: an image without ``mesh_main``; 4: DATA and WRITE, a program's data in device memory, and PAYLOADS,
#: a module's payload region).
PROTOCOL_VERSION = 4
#: The versions whose workers this daemon adopts (docs/protocol.md, "Versions").  A worker of
#: another version is told to QUIT (it halts its kernels first) and its programs are reloaded:
#: what stays readable across every version is the frame header, the op numbers of HELLO and
#: QUIT, and HELLO's first two words (version, pid).
ADOPTS = frozenset({2, 3, 4})  # a worker of 2 is answered as before: it never sends ok word 3
#: The first version whose workers take DATA and WRITE: an older one adopted is never sent them.
DATA_SINCE = 4
#: The first version whose workers take PAYLOADS: an older one (adopted) is never sent it.
PAYLOADS_SINCE = 4
#: Largest ``length`` accepted (op + body): a cubin travels in one LOAD frame.
MAX_FRAME = 64 << 20


class Op(enum.IntEnum):
    READY = 1
    LOAD = 2
    LOADED = 3
    LAUNCH = 4
    LAUNCHED = 5
    DONE = 6
    UNLOAD = 7
    QUIT = 8
    LIMIT = 9  # the context's stack limit: get, or set then get
    HELLO = 10  # a --listen worker's first frame on each connection: who it is, what it runs
    DATA = 11  # a slot's program data: allocated and copied in from a file (alloc 0: freed)
    WRITE = 12  # bytes copied into a slot's program data at an offset, on the worker's own stream
    PAYLOADS = 13  # a module's payload region: mapped and registered by its worker, get its device address


#: LIMIT's body: set (u32 0/1), bytes (u64); its reply: ok, bytes (u64)
LIMIT_BODY = struct.Struct("<IQ")


#: The reply each request is answered with (UNLOAD and QUIT are not answered; DONE comes on its own).
REPLY = {Op.READY: Op.READY, Op.LOAD: Op.LOADED, Op.LAUNCH: Op.LAUNCHED, Op.LIMIT: Op.LIMIT, Op.DATA: Op.DATA,
         Op.WRITE: Op.WRITE, Op.PAYLOADS: Op.PAYLOADS}
#: Ops a worker sends only in answer to a request (LIMIT, DATA, WRITE and PAYLOADS answer themselves).
REPLIES = frozenset(REPLY.values())


_HEAD_OP = struct.Struct("<IB")  # a frame's length and op: one pack on every ask's path


def encode(op: Op | int, body: bytes = b"") -> bytes:
    n = 1 + len(body)
    if n > MAX_FRAME:
        raise FrameError(f"frame of {n} bytes is over the {MAX_FRAME}-byte limit")
    return _HEAD_OP.pack(n, op) + body


def check_length(n: int) -> None:
    if n == 0:
        raise FrameError("frame length 0 (no op byte)")
    if n > MAX_FRAME:
        raise FrameError(f"frame length {n} is over the {MAX_FRAME}-byte limit")


_OPS = {int(op): op for op in Op}


def check_op(b: int) -> Op:
    op = _OPS.get(b)  # a dict, not Op(b): this runs for every frame
    if op is None:
        raise FrameError(f"unknown op {b}")
    return op


def decode(buf: bytes) -> tuple[Op, bytes, int]:
    """One whole frame from the front of ``buf``: (op, body, bytes used).

    Raises FrameError for a bad frame and for a short buffer, so that a
    fuzzer can drive it with arbitrary bytes.
    """
    if len(buf) < HEADER.size:
        raise FrameError(f"short frame: {len(buf)} bytes, no length")
    (n,) = HEADER.unpack_from(buf)
    check_length(n)
    end = HEADER.size + n
    if len(buf) < end:
        raise FrameError(f"short frame: length {n}, {len(buf) - HEADER.size} bytes present")
    op = check_op(buf[HEADER.size])
    return op, bytes(buf[HEADER.size + 1 : end]), end


# ---- bodies ---------------------------------------------------------------------------------

U32 = struct.Struct("<I")
READY_BODY = struct.Struct("<II")  # ok, pid
LOAD_HEAD = struct.Struct("<IIIIQI")  # module, threads, smem, scratch, tag, name length
LOADED_BODY = struct.Struct("<IIIIIIQQ")  # ok, rt_abi, regs, per_sm, local, sms, dev, scratch
LAUNCH_BODY = struct.Struct("<IIII")  # module, gen, slot, nodes
UNLOAD_BODY = struct.Struct("<I")  # module
PAYLOADS_HEAD = struct.Struct("<III")  # module, max_request, max_response; then the region's path
DONE_HEAD = struct.Struct("<III")  # module, gen, ok
MAX_NAME = 255


def _exact(what: str, s: struct.Struct, body: bytes) -> tuple[int, ...]:
    if len(body) != s.size:
        raise FrameError(f"{what} body of {len(body)} bytes, expected {s.size}")
    return s.unpack(body)


def _text(b: bytes) -> str:
    return b.decode("utf-8", "replace")


@dataclass(frozen=True)
class Load:
    module: int
    threads: int
    smem: int
    scratch: int
    name: str
    cubin: bytes
    #: The program's hash (Prepared.hash): the worker says it back in HELLO, so that an adopting
    #: daemon knows which version of the program a module is; opaque to the GPU's worker, the
    #: simulated GPU knows the shipped examples by it (meshd_mps/gpu/examples.py).
    tag: int = 0

    def encode(self) -> bytes:
        name = self.name.encode()
        if len(name) > MAX_NAME:
            raise FrameError(f"program name of {len(name)} bytes is over {MAX_NAME}")
        return LOAD_HEAD.pack(self.module, self.threads, self.smem, self.scratch, self.tag, len(name)) + name + self.cubin

    @classmethod
    def decode(cls, body: bytes) -> Load:
        if len(body) < LOAD_HEAD.size:
            raise FrameError(f"LOAD body of {len(body)} bytes, shorter than its {LOAD_HEAD.size}-byte head")
        module, threads, smem, scratch, tag, nn = LOAD_HEAD.unpack_from(body)
        if nn > MAX_NAME or LOAD_HEAD.size + nn > len(body):
            raise FrameError(f"LOAD name length {nn} does not fit its {len(body)}-byte body")
        name = body[LOAD_HEAD.size : LOAD_HEAD.size + nn]
        return cls(module, threads, smem, scratch, _text(name), bytes(body[LOAD_HEAD.size + nn :]), tag)


@dataclass(frozen=True)
class Loaded:
    """What a worker reports of the module it loaded (the seed's ``winfo`` and ``dev``)."""

    rt_abi: int
    regs: int
    per_sm: int
    local: int
    sms: int
    dev: int
    scratch: int

    def encode(self) -> bytes:
        return LOADED_BODY.pack(1, self.rt_abi, self.regs, self.per_sm, self.local, self.sms, self.dev, self.scratch)

    @classmethod
    def decode_ok(cls, payload: bytes) -> Loaded:
        """From the payload after the ok word."""
        v = _exact("LOADED", LOADED_BODY, U32.pack(1) + payload)
        return cls(*v[1:])


@dataclass(frozen=True)
class LaunchReq:
    """A LAUNCH request's body: which module's kernel, its generation, slot and blocks (what a
    program's residency, ``isolation.launch.Launch``, starts with)."""

    module: int
    gen: int
    slot: int
    nodes: int

    def encode(self) -> bytes:
        return LAUNCH_BODY.pack(self.module, self.gen, self.slot, self.nodes)

    @classmethod
    def decode(cls, body: bytes) -> LaunchReq:
        return cls(*_exact("LAUNCH", LAUNCH_BODY, body))


@dataclass(frozen=True)
class PayloadsReq:
    """A PAYLOADS request's body: module ``module``'s payload region, the file at ``path`` laid out for
    requests of ``max_request`` and responses of ``max_response`` bytes (protocol/payloads.py);
    answered with its device address (``u64_value``), which the worker writes into the slot too."""

    module: int
    max_request: int
    max_response: int
    path: str

    def encode(self) -> bytes:
        return PAYLOADS_HEAD.pack(self.module, self.max_request, self.max_response) + self.path.encode()

    @classmethod
    def decode(cls, body: bytes) -> PayloadsReq:
        if len(body) <= PAYLOADS_HEAD.size:
            raise FrameError(f"PAYLOADS body of {len(body)} bytes: its {PAYLOADS_HEAD.size}-byte head and a path expected")
        module, req, resp = PAYLOADS_HEAD.unpack_from(body)
        return cls(module, req, resp, _text(body[PAYLOADS_HEAD.size :]))


@dataclass(slots=True)
class Done:
    """Not frozen: a frozen dataclass's ``__init__`` costs ~0.5 us, against ~0.13 us, and every
    launch's DONE is decoded on the event loop (docs/benchmarks.md, row b)."""

    module: int
    gen: int
    ok: bool
    message: str = ""

    def encode(self) -> bytes:
        return DONE_HEAD.pack(self.module, self.gen, 1 if self.ok else 0) + self.message.encode()

    @classmethod
    def decode(cls, body: bytes) -> Done:
        if len(body) < DONE_HEAD.size:
            raise FrameError(f"DONE body of {len(body)} bytes, shorter than {DONE_HEAD.size}")
        module, gen, ok = DONE_HEAD.unpack_from(body)
        if ok == 1 and len(body) == DONE_HEAD.size:  # the usual DONE: ended well, no text
            return cls(module, gen, True)
        if ok not in (0, 1):
            raise FrameError(f"DONE ok word {ok}, expected 0 or 1")
        return cls(module, gen, ok == 1, _text(body[DONE_HEAD.size :]))


HELLO_HEAD = struct.Struct("<IIIII")  # version, pid, device, modules, launches
#: id, gen (its last launch's; 0: none), tag (LOAD's), its LOADED report (LOADED_BODY less ok), name
#: length; then the name
HELLO_MODULE = struct.Struct("<IIQIIIIIQQI")
HELLO_LAUNCH = struct.Struct("<IIIII")  # module, gen, slot, nodes, running (1; 0: ended, its DONE follows)


@dataclass(frozen=True)
class HelloModule:
    id: int
    gen: int  # the module's last launch's generation (0: never launched)
    name: str
    tag: int = 0  # its LOAD's tag: the program's hash
    info: Loaded = Loaded(0, 0, 0, 0, 0, 0, 0)  # what its LOADED reported


@dataclass(frozen=True)
class HelloLaunch:
    """A launch whose DONE no daemon has had: running, or ended while none was connected (its DONE
    is the next frames after HELLO)."""

    module: int
    gen: int
    slot: int
    nodes: int
    running: bool


@dataclass(frozen=True)
class Hello:
    """What a worker in listen mode says first on each connection (docs/protocol.md), so that a
    daemon that did not start it can adopt it: the protocol version, its pid and GPU, its modules,
    its launches not yet reported, and the mailbox it maps."""

    version: int
    pid: int
    device: int
    modules: tuple[HelloModule, ...] = ()
    launches: tuple[HelloLaunch, ...] = ()
    mailbox: str = ""

    def encode(self) -> bytes:
        out = [HELLO_HEAD.pack(self.version, self.pid, self.device, len(self.modules), len(self.launches))]
        for m in self.modules:
            name = m.name.encode()[:MAX_NAME]
            i = m.info
            out.append(HELLO_MODULE.pack(m.id, m.gen, m.tag, i.rt_abi, i.regs, i.per_sm, i.local, i.sms, i.dev,
                                         i.scratch, len(name)) + name)
        for la in self.launches:
            out.append(HELLO_LAUNCH.pack(la.module, la.gen, la.slot, la.nodes, 1 if la.running else 0))
        out.append(self.mailbox.encode())
        return b"".join(out)

    @staticmethod
    def head(body: bytes) -> tuple[int, int]:
        """(version, pid): readable whatever the version, so that a mismatch is named, not misparsed."""
        if len(body) < 8:
            raise FrameError(f"HELLO body of {len(body)} bytes, no version and pid")
        v, pid = struct.unpack_from("<II", body)
        return v, pid

    @classmethod
    def decode(cls, body: bytes) -> Hello:
        if len(body) < HELLO_HEAD.size:
            raise FrameError(f"HELLO body of {len(body)} bytes, shorter than its {HELLO_HEAD.size}-byte head")
        version, pid, device, nm, nl = HELLO_HEAD.unpack_from(body)
        at = HELLO_HEAD.size
        modules = []
        for _ in range(nm):
            if at + HELLO_MODULE.size > len(body):
                raise FrameError(f"HELLO: {nm} modules do not fit its {len(body)}-byte body")
            mid, gen, tag, *info, n = HELLO_MODULE.unpack_from(body, at)
            at += HELLO_MODULE.size
            if n > MAX_NAME or at + n > len(body):
                raise FrameError(f"HELLO: module {mid}'s name length {n} does not fit its {len(body)}-byte body")
            modules.append(HelloModule(mid, gen, _text(body[at : at + n]), tag, Loaded(*info)))
            at += n
        launches = []
        for _ in range(nl):
            if at + HELLO_LAUNCH.size > len(body):
                raise FrameError(f"HELLO: {nl} launches do not fit its {len(body)}-byte body")
            module, gen, slot, nodes, running = HELLO_LAUNCH.unpack_from(body, at)
            at += HELLO_LAUNCH.size
            if running not in (0, 1):
                raise FrameError(f"HELLO: launch {module}/{gen} running word {running}, expected 0 or 1")
            launches.append(HelloLaunch(module, gen, slot, nodes, running == 1))
        return cls(version, pid, device, tuple(modules), tuple(launches), _text(body[at:]))


DATA_HEAD = struct.Struct("<IQQ")  # slot, alloc, length; then the file's path (UTF-8)
DATA_REPLY = struct.Struct("<QQ")  # dev (the data's device address), alloc
WRITE_HEAD = struct.Struct("<IQ")  # slot, offset; then the bytes


@dataclass(frozen=True)
class DataReq:
    """DATA's body: slot ``slot``'s program data, ``alloc`` bytes of device memory holding the first
    ``length`` bytes of the file ``path`` (the rest zeroed); a region the slot had is freed first.
    ``alloc`` 0: the slot's region freed, nothing else (``length`` 0, no path)."""

    slot: int
    alloc: int
    length: int = 0
    path: str = ""

    def encode(self) -> bytes:
        return DATA_HEAD.pack(self.slot, self.alloc, self.length) + self.path.encode()

    @classmethod
    def decode(cls, body: bytes) -> DataReq:
        if len(body) < DATA_HEAD.size:
            raise FrameError(f"DATA body of {len(body)} bytes, shorter than its {DATA_HEAD.size}-byte head")
        slot, alloc, length = DATA_HEAD.unpack_from(body)
        if length > alloc:
            raise FrameError(f"DATA length {length} is over its allocation of {alloc} bytes")
        return cls(slot, alloc, length, _text(body[DATA_HEAD.size :]))


@dataclass(frozen=True)
class WriteReq:
    """WRITE's body: ``data`` copied into slot ``slot``'s program data at ``offset``; answered once
    the copy is complete on the device."""

    slot: int
    offset: int
    data: bytes

    def encode(self) -> bytes:
        return WRITE_HEAD.pack(self.slot, self.offset) + self.data

    @classmethod
    def decode(cls, body: bytes) -> WriteReq:
        if len(body) < WRITE_HEAD.size:
            raise FrameError(f"WRITE body of {len(body)} bytes, shorter than its {WRITE_HEAD.size}-byte head")
        slot, offset = WRITE_HEAD.unpack_from(body)
        return cls(slot, offset, bytes(body[WRITE_HEAD.size :]))


def data_reply(dev: int, alloc: int) -> bytes:
    return ok_reply(DATA_REPLY.pack(dev, alloc))


def data_placed(payload: bytes) -> tuple[int, int]:
    """A DATA reply's payload: (the data's device address, its allocation)."""
    return _exact("DATA reply", DATA_REPLY, payload)  # type: ignore[return-value]


#: AF_UNIX paths stop at 107 bytes (sun_path is 108, with its NUL); a pid has at most 7 digits
#: (pid_max is at most 4194304).
SUN_PATH_MAX = 107


def listen_path(dir: str, pid: int) -> str:
    """The socket of the worker ``pid`` started with ``--listen DIR``."""
    return os.path.join(dir, f"{pid}.sock")


def listen_dir_fits(dir: str) -> bool:
    """Every worker's socket under ``dir`` fits an AF_UNIX address."""
    return len(listen_path(dir, 4194304).encode()) <= SUN_PATH_MAX


def unload_body(module: int) -> bytes:
    return UNLOAD_BODY.pack(module)


def unload_module(body: bytes) -> int:
    return _exact("UNLOAD", UNLOAD_BODY, body)[0]


def limit_body(set_to: int | None) -> bytes:
    return LIMIT_BODY.pack(0 if set_to is None else 1, set_to or 0)


def limit_request(body: bytes) -> int | None:
    set_, value = _exact("LIMIT", LIMIT_BODY, body)
    if set_ not in (0, 1):
        raise FrameError(f"LIMIT set word {set_}, expected 0 or 1")
    return value if set_ else None


def u64_value(op: Op, payload: bytes) -> int:
    """The u64 of an ok reply that carries one (LIMIT's bytes, PAYLOADS' device address)."""
    if len(payload) != 8:
        raise FrameError(f"{op.name} reply payload of {len(payload)} bytes, expected a u64")
    return struct.unpack("<Q", payload)[0]


def ok_reply(payload: bytes = b"") -> bytes:
    return U32.pack(1) + payload


#: A reply's ok word: 1 done; 0 failed (the GPU or the worker); 2 refused: the driver refused
#: the request's image itself (LOADED only: not a cubin for this GPU); 3 no entry: the image has no
#: ``mesh_main`` (LOADED only, since protocol 3; a refusal too, said as what the program lacks).
OK, FAILED, REFUSED, NO_ENTRY = 1, 0, 2, 3
#: The ok words only a LOADED reply may carry.
LOADED_ONLY = (REFUSED, NO_ENTRY)


#: What a program's entry must be (docs/program-abi.md): said where an image lacks it.
ENTRY_DECL = f'extern "C" __global__ void {ENTRY}(unsigned long long mailbox, unsigned int slot)'


#: The driver's words for an image without the entry (cuModuleGetFunction), as a worker reports them.
DRIVER_NO_ENTRY = f"cuModuleGetFunction({ENTRY}): CUDA_ERROR_NOT_FOUND (named symbol not found)"


class NoEntry(ImageRefused):
    """LOADED's ok word NO_ENTRY as the daemon says it: an image without ``mesh_main``, most often
    declared without ``extern "C"``, so that its name is mangled.  ``driver``: the driver's words;
    ``read``: found in the cubin before any load (the driver's words are then what it would say)."""

    def __init__(self, *, driver: str, read: bool = False):
        said = (f"read from the cubin before it was loaded (the driver would say {driver})" if read
                else f"the driver said {driver}")
        super().__init__(f"no `{ENTRY_DECL}` in the program: declare the entry so, with extern \"C\" (without it the"
                         f" name is mangled; docs/program-abi.md); {said}", driver=driver)


def error_reply(message: str, refused: bool = False, *, word: int | None = None) -> bytes:
    """A failed reply: ok word ``word`` (default FAILED, or REFUSED if ``refused``), then the text."""
    return U32.pack(word if word is not None else REFUSED if refused else FAILED) + message.encode()


def split_reply(op: Op, body: bytes) -> tuple[int, bytes]:
    """A reply's ok word (``OK``, ``FAILED`` or, for LOADED, ``REFUSED`` or ``NO_ENTRY``) and the
    rest: the payload, or the error text."""
    if len(body) < U32.size:
        raise FrameError(f"{op.name} reply of {len(body)} bytes, no ok word")
    (ok,) = U32.unpack_from(body)
    if ok not in (OK, FAILED) and not (ok in LOADED_ONLY and op == Op.LOADED):
        raise FrameError(f"{op.name} reply ok word {ok}, expected 0 or 1" + (", 2 or 3" if op == Op.LOADED else ""))
    return ok, body[U32.size :]


def ready_reply(pid: int) -> bytes:
    return READY_BODY.pack(1, pid)


def ready_pid(payload: bytes) -> int:
    if len(payload) != U32.size:
        raise FrameError(f"READY reply payload of {len(payload)} bytes, expected a u32 pid")
    return U32.unpack(payload)[0]


def reply_text(payload: bytes) -> str:
    return _text(payload)
