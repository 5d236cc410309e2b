"""``meshd-mps check DIR``: a program checked without a GPU, as far as a load would check it.

The simulated GPU runs only the shipped examples (by image), so a user's own program is never
run on a CPU machine; this is how it is checked there.  Each step is the one a load takes, by the
same code: the files read as ``load`` reads them (``program_body``, CUDA C compiled for the
target's arch), the manifest (``Manifest.parse``) and the device's per-block limits
(``Compiler.check``), nvJitLink for the target with the register cap a load uses, then what the
worker asks the driver of a loaded module, read from the cubin instead (``gpu/cubin.py``: the
entry ``mesh_main``, the ``mesh_rt_abi`` global, registers per thread), and whether every block
can be resident at once (``isolation/limits.py``, at an occupancy reckoned from the registers,
threads and shared memory, where the worker asks cuOccupancyMaxActiveBlocksPerMultiprocessor).

The target is the daemon's GPU when one answers on the socket (its oldest, whose arch ``load``
compiles for), else ``--arch`` (default sm_90) with an H200's figures.
"""

from __future__ import annotations

import json
import re
import sys
from dataclasses import dataclass, field, replace
from typing import Any

from meshd_mps.base.errors import MeshError
from meshd_mps.gpu.device import DeviceInfo, simulated_device
from meshd_mps.protocol import abi

#: The arch checked for when neither a daemon nor ``--arch`` names one.
DEFAULT_ARCH = "sm_90"
#: Registers per SM on every architecture meshd-mps compiles for (sm_70 on).
REGS_PER_SM = 65536
#: Threads per SM where it is not 2048 (the consumer and embedded parts).
THREADS_PER_SM = {(8, 6): 1536, (8, 7): 1024, (8, 9): 1536, (12, 0): 1536}
#: Shared memory the driver reserves per block (sm_80 on).
SMEM_RESERVED = 1024
_ARCH = re.compile(r"^(?:sm|compute)_(\d)(\d+)a?$")


@dataclass
class Step:
    check: str
    ok: bool
    detail: str
    numbers: dict[str, Any] = field(default_factory=dict)


@dataclass
class Target:
    info: DeviceInfo
    sms: int
    why: str  # where the target came from


def parse_arch(arch: str) -> tuple[int, int]:
    m = _ARCH.match(arch)
    if not m:
        raise ValueError(f"--arch {arch!r}: sm_XY expected (e.g. sm_90)")
    return int(m[1]), int(m[2])


def target(arch: str | None, socket: str) -> Target:
    """The GPU to check for: ``arch`` (an H200's figures otherwise), else the daemon's oldest GPU,
    else DEFAULT_ARCH."""
    h200 = simulated_device()
    if arch is None:
        from meshd_mps.serving.client import Client, ClientError, NoDaemon

        c = Client(socket, timeout=5)
        try:
            st = c.status()
        except NoDaemon:
            arch, why = DEFAULT_ARCH, f"the default: no daemon at {c.socket}; --arch to choose"
        except ClientError as e:
            arch, why = DEFAULT_ARCH, f"the default: the daemon at {c.socket} did not say ({e}); --arch to choose"
        else:
            given = [d.get("caps") for d in st.get("devices") or [] if isinstance(d, dict)] or [st.get("caps")]
            caps: list[dict[str, Any]] = [x for x in given if isinstance(x, dict) and isinstance(x.get("cc_major"), int)]
            if caps:
                cap = min(caps, key=lambda x: (x["cc_major"], x.get("cc_minor", 0)))
                info = replace(h200, name=str(cap.get("name", h200.name)), cc_major=cap["cc_major"],
                               cc_minor=int(cap.get("cc_minor", 0)), sms_total=int(cap.get("sms_total", h200.sms_total)),
                               blocks_per_sm=int(cap.get("blocks_per_sm", h200.blocks_per_sm)),
                               max_threads=int(cap.get("max_threads", h200.max_threads)),
                               max_shared=int(cap.get("max_shared", h200.max_shared)))
                return Target(info, int(cap.get("sms") or info.sms_total), f"the daemon's GPU, at {c.socket}")
            arch, why = DEFAULT_ARCH, f"the default: the daemon at {c.socket} names no GPU; --arch to choose"
    else:
        why = "--arch"
    major, minor = parse_arch(arch)
    info = replace(h200, name=f"sm_{major}{minor} (an H200's figures)" if (major, minor) != (9, 0) else "an H200",
                   cc_major=major, cc_minor=minor)
    return Target(info, info.sms_total, why)


def per_sm(t: Target, threads: int, regs: int, smem: int) -> tuple[int, str]:
    """Blocks of a kernel that fit one SM, and what limits them: the device's most blocks, its
    threads, its registers (allocated per warp in units of 256) and its shared memory."""
    info = t.info
    warps = -(-threads // 32)
    per_warp = -(-max(regs, 1) * 32 // 256) * 256
    smem_sm = info.max_shared + SMEM_RESERVED
    fits = {
        "blocks per SM": info.blocks_per_sm,
        "threads": THREADS_PER_SM.get((info.cc_major, info.cc_minor), 2048) // threads,
        "registers": REGS_PER_SM // (warps * per_warp),
        "shared memory": smem_sm // (smem + SMEM_RESERVED),
    }
    by = min(fits, key=lambda k: fits[k])
    return fits[by], by


def run(t: Target, dir: str | None, manifest: str | None, ptx: str | None, cuda: str | None, nodes: int) -> list[Step]:
    """Every check, in a load's order, up to the first that fails."""
    from meshd_mps.gpu.compiler import Compiler, Manifest, ptx_to_cubin
    from meshd_mps.gpu.cubin import STT_FUNC, STT_OBJECT, Cubin, CubinError
    from meshd_mps.isolation.limits import check_nodes, check_resident
    from meshd_mps.state.program_files import program_body

    steps: list[Step] = []

    def fail(check: str, detail: str) -> list[Step]:
        steps.append(Step(check, False, detail))
        return steps

    info = t.info
    try:
        body = program_body(dir, manifest, ptx, cuda, arch=info.compute)
    except MeshError as e:
        return fail("files", str(e))
    steps.append(Step("files", True, f"{dir or manifest}: the manifest and the program, read as load reads them"
                      f" (CUDA C compiled here for {info.compute})"))
    try:
        m = Manifest.parse(body["manifest"])
    except MeshError as e:
        return fail("manifest", str(e))
    steps.append(Step("manifest", True, f"{m.name}: {m.warps} warps ({m.threads} threads), {m.smem} bytes of shared"
                      f" memory, program ABI {m.abi}", {"warps": m.warps, "threads": m.threads, "smem": m.smem}))
    text = body["ptx"].encode()
    try:
        _m, image, cap = Compiler(info).check(m, text)
    except MeshError as e:
        return fail("limits", str(e))
    steps.append(Step("limits", True, f"{m.threads} threads and {m.smem} bytes of shared memory per block: {info.name}"
                      f" allows {info.max_threads} and {info.max_shared}; hash {image:016x} (as load and ps show it)",
                      {"hash": f"{image:016x}"}))
    try:
        cubin = ptx_to_cubin(text, info.arch, cap)
    except MeshError as e:
        return fail("compile", str(e))
    except Exception as e:  # nvJitLink's library missing or broken: one line, not a traceback
        return fail("compile", f"nvJitLink failed: {type(e).__name__}: {e}")
    from meshd_mps.gpu.examples import cubin_id

    steps.append(Step("compile", True, f"nvJitLink for {info.arch}, at most {cap} registers a thread: a cubin of"
                      f" {len(cubin)} bytes, cubin {cubin_id(cubin):016x} (the simulated GPU knows an example by it)",
                      {"arch": info.arch, "reg_cap": cap, "cubin": f"{cubin_id(cubin):016x}"}))
    try:
        elf = Cubin(cubin)
    except CubinError as e:
        return fail("entry", f"the cubin cannot be read here: {e}")
    if elf.symbol(abi.ENTRY, STT_FUNC) is None:
        return fail("entry", f"no kernel {abi.ENTRY}: define it as extern \"C\" __global__ void {abi.ENTRY}(unsigned long"
                    " long mailbox, unsigned int slot), or MESH_MAIN { ... } of mesh_program.h (docs/program-abi.md)")
    steps.append(Step("entry", True, f"{abi.ENTRY} is a kernel"))
    sym = elf.symbol(abi.RT_ABI_SYMBOL, STT_OBJECT)
    got = None if sym is None else elf.u32(sym)
    if got != abi.RT_ABI:
        why = f"no global {abi.RT_ABI_SYMBOL} (it reads as ABI 0)" if sym is None else f"{abi.RT_ABI_SYMBOL} = {got}"
        return fail("abi", f"{why}: this meshd-mps speaks program ABI {abi.RT_ABI}; add MESH_DEFINE_RT_ABI();"
                    " (docs/program-abi.md, section 2)")
    steps.append(Step("abi", True, f"{abi.RT_ABI_SYMBOL} = {got}, the program ABI this meshd-mps speaks", {"abi": got}))
    regs = elf.registers(abi.ENTRY)
    if regs is None:
        return fail("registers", f"the cubin does not say how many registers {abi.ENTRY} uses")
    steps.append(Step("registers", True, f"{regs} per thread (the cap is {cap}), {regs * m.threads} per block",
                      {"registers": regs, "cap": cap}))
    fit, by = per_sm(t, m.threads, regs, m.smem)
    try:
        check_nodes(m.name, nodes, info, t.sms, 0.0)
        check_resident(m.name, nodes, fit, t.sms, 0.0)
    except MeshError as e:
        steps.append(Step("resident", False, f"{e} (at most {fit} of its blocks an SM, by its {by})",
                          {"nodes": nodes, "per_sm": fit, "sms": t.sms, "limited_by": by}))
        return steps
    steps.append(Step("resident", True, f"{nodes} of {fit * t.sms} blocks at once ({fit} an SM by its {by}, on {t.sms}"
                      " SMs), on a GPU with nothing else running", {"nodes": nodes, "per_sm": fit, "sms": t.sms,
                                                                      "limited_by": by}))
    return steps


def sim_verdict(t: Target, steps: list[Step]) -> str:
    """What the simulated GPU (``--gpu sim``) makes of the image: it runs only the shipped examples,
    known by their cubin (the compiled image), so it is the cubin compiled here that is compared."""
    from meshd_mps.gpu.examples import example_images

    cubin = next(s.numbers["cubin"] for s in steps if s.check == "compile")
    kind = example_images(t.info).get(int(cubin, 16))
    if kind is not None:
        return f"its cubin is the example {kind}'s: the simulated GPU runs it as {kind}"
    return ("its cubin is none of the shipped examples': the simulated GPU refuses it (it runs no GPU code),"
            " run it on a GPU")


def main(args: Any, socket: str) -> int:
    """The command: one line per check, then the verdict; 0 if every check passes, else 1 (2: a
    bad option).  ``socket``: the daemon whose GPU is the target unless ``--arch`` names one."""
    nodes = 1 if args.nodes is None else args.nodes
    try:
        t = target(args.arch, socket)
    except ValueError as e:
        print(f"meshd-mps: check: {e}", file=sys.stderr)
        return 2
    steps = run(t, args.dir, args.manifest, args.ptx, args.cuda, nodes)
    ok = all(s.ok for s in steps) and len(steps) == 8
    what = args.dir or args.manifest or "the program"
    if args.json:
        print(json.dumps({"ok": ok, "program": what, "target": {"name": t.info.name, "arch": t.info.arch, "sms": t.sms,
                                                                  "from": t.why},
                          "checks": [{"check": s.check, "ok": s.ok, "detail": s.detail, **s.numbers} for s in steps]},
                         indent=2))
        return 0 if ok else 1
    print(f"target: {t.info.arch}, {t.info.name}, {t.sms} SMs ({t.why})")
    for s in steps:
        print(f"{'OK  ' if s.ok else 'FAIL'} {s.check}: {s.detail}")
    if ok:
        print(f"{what}: every check passes; {sim_verdict(t, steps)}")
        return 0
    print(f"meshd-mps: check: {what}: the {steps[-1].check} check failed (FAIL above)", file=sys.stderr)
    return 1
