"""A program's files read into a load body (its manifest and PTX; CUDA C compiled to PTX here, by
whoever reads them, with their own rights): what ``meshd-mps load DIR`` sends, and what a restore
loads for a program the config file declares (state/desired.py).  Below both: the CLI's client
(serving/client.py) re-exports it, and the desired state needs no serving module to read them."""

from __future__ import annotations

import os
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Any

from meshd_mps.base.errors import BadRequest
from meshd_mps.base.strictjson import parse_json

#: The architecture CUDA C is compiled for when no daemon is asked (``program_body`` without ``arch``).
DEFAULT_ARCH = "compute_90"


class ProgramFilesError(BadRequest):
    """A program's files that make no load body (unreadable, not one program, not JSON, CUDA C that
    does not compile); ``path``: the file or directory at fault ("" when none was named)."""

    FIELDS = ("path",)

    def __init__(self, message: str, path: object = ""):
        super().__init__(message)
        self.path = str(path)


def compile_cuda(source: bytes, name: str, arch: str, include: list[str] | None = None) -> str:
    """CUDA C -> PTX text here, in this process (NVRTC, with the caller's own file access; the
    examples' ``mesh_program.h`` on the include path): ProgramFilesError with NVRTC's log, never a
    traceback."""
    try:
        from meshd_mps.base.errors import CompileError
        from meshd_mps.gpu.compiler import cuda_to_ptx
    except ImportError as e:
        raise ProgramFilesError(f"{name}: compiling CUDA C needs meshd-mps's compiler: {e}") from e
    try:
        ptx = cuda_to_ptx(source, name, arch, include)
    except CompileError as e:
        raise ProgramFilesError(str(e)) from e
    except ImportError as e:  # cuda.bindings is imported by the call
        raise ProgramFilesError(f"{name}: compiling CUDA C needs NVRTC (the cuda-bindings package): {e}") from e
    except Exception as e:  # NVRTC's library missing or broken: said in one line, not a traceback
        raise ProgramFilesError(f"{name}: NVRTC failed: {type(e).__name__}: {e}") from e
    try:
        return ptx.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ProgramFilesError(f"{name}: NVRTC's PTX is not UTF-8 text: {e}") from e


#: The most a program file read here may hold: the daemon's whole request body (64 MiB).
MAX_FILE = 64 << 20


def read_file(path: Path) -> bytes:
    """A regular file's bytes, at most MAX_FILE; ProgramFilesError otherwise (a device such as /dev/zero
    would be read without end, a FIFO would wait for a writer)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)  # a FIFO's open would wait
    except OSError as e:
        raise ProgramFilesError(f"{path}: {e.strerror or e}", path) from e
    with open(fd, "rb", buffering=0) as f:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ProgramFilesError(f"{path}: not a regular file", path)
        if st.st_size > MAX_FILE:
            raise ProgramFilesError(f"{path}: {st.st_size} bytes, over the limit of {MAX_FILE} (64 MiB)", path)
        try:
            return f.read(MAX_FILE)
        except OSError as e:
            raise ProgramFilesError(f"{path}: {e.strerror or e}", path) from e


def program_body(dir: str | None = None, manifest: str | None = None, ptx: str | None = None, cuda: str | None = None,
                 hash: str | None = None, nodes: int | None = None, device: int | None = None,
                 arch: str | Callable[[], str] | None = None, restart: str | None = None,
                 check: Callable[[str], None] | None = None) -> dict[str, Any]:
    """A load/upgrade body from files: a program directory (manifest.json and one ``*.ptx``
    or ``*.cu``) or ``manifest`` with ``ptx`` or ``cuda``; ``device``: the GPU (a CUDA ordinal);
    ``restart``: its restart policy (on-failure, always, never; the daemon checks it).
    The body always carries PTX: CUDA C is compiled here (:func:`compile_cuda`, the source's own
    directory on the include path) for ``arch`` (``compute_XY``, or a function that returns it,
    called only then, e.g. :meth:`Client.arch`; default ``DEFAULT_ARCH``).  ``check``: called with
    the program's name before CUDA C is compiled, to refuse it first (the client asks the daemon
    whether that name is loaded already: a refusal that is sure should not wait for a compile).
    ProgramFilesError says what is wrong."""
    if dir is not None:
        d = Path(dir)
        if not d.is_dir():
            why = "not a directory (a program directory holds manifest.json and a .ptx or .cu file)" if d.exists() \
                else "no such directory"
            raise ProgramFilesError(f"{dir}: {why}", dir)
        mpath = Path(manifest) if manifest else d / "manifest.json"
        if ptx is None and cuda is None:
            ptxs, cus = sorted(d.glob("*.ptx")), sorted(d.glob("*.cu"))
            if len(ptxs) == 1:
                ptx = str(ptxs[0])
            elif len(ptxs) > 1:
                raise ProgramFilesError(f"{dir}: {len(ptxs)} .ptx files; name one with --ptx", dir)
            elif len(cus) == 1:
                cuda = str(cus[0])
            elif len(cus) > 1:
                raise ProgramFilesError(f"{dir}: {len(cus)} .cu files; name one with --cuda", dir)
            else:
                raise ProgramFilesError(f"{dir}: no .ptx or .cu file", dir)
    elif manifest is not None:
        mpath = Path(manifest)
    else:
        raise ProgramFilesError("a program directory or --manifest FILE is needed")
    if (ptx is None) == (cuda is None):
        raise ProgramFilesError("one of --ptx FILE or --cuda FILE is needed")
    mtext = read_file(mpath)
    try:
        mobj = parse_json(mtext)
    except ValueError as e:
        raise ProgramFilesError(f"{mpath}: not JSON: {e}", mpath) from e
    src = Path(ptx if ptx is not None else cuda)  # type: ignore[arg-type]
    raw = read_file(src)
    if ptx is not None:
        from meshd_mps.gpu.compiler import ptx_version

        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise ProgramFilesError(f"{src}: not UTF-8 text: {e}", src) from e
        if ptx_version(raw) is None:  # every PTX module begins with its .version: this file is something else
            raise ProgramFilesError(f"{src}: not PTX (no .version directive, with which every PTX file begins);"
                                    " give a program's CUDA C with --cuda", src)
    else:
        given = mobj.get("name") if isinstance(mobj, dict) else None
        name = given if isinstance(given, str) else src.stem
        if check is not None:
            check(name)
        target = arch() if callable(arch) else (arch or DEFAULT_ARCH)
        text = compile_cuda(raw, name, target, [str(src.resolve().parent)])
    body: dict[str, Any] = {"manifest": mobj, "ptx": text}
    if hash is not None:
        body["hash"] = hash
    if nodes is not None:
        body["nodes"] = nodes
    if device is not None:
        body["device"] = device
    if restart is not None:
        body["restart"] = restart
    return body
