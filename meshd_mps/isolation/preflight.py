"""What a load is refused for that the cubin itself says, read before the module change.

In blink mode a module load halts every running program of the context (it waits for every running
kernel), so a load the worker would refuse afterwards (no ``mesh_main``, another program ABI; on the
simulated GPU an image that is none of the shipped examples) halted them for nothing.  These checks
need no GPU: the cubin is read here (``gpu/cubin.py``), as ``meshd-mps check`` reads it, and the same
error types are raised as the worker's refusal and ``Isolation._check_abi`` raise.  What only the
driver can say (an image it cannot load on this GPU, the blocks an SM takes) is still said by the
worker, inside the blink.
"""

from __future__ import annotations

from meshd_mps.base.errors import AbiMismatch, ImageRefused
from meshd_mps.gpu.compiler import Prepared
from meshd_mps.gpu.cubin import STT_FUNC, STT_OBJECT, Cubin, CubinError
from meshd_mps.gpu.device import DeviceInfo
from meshd_mps.protocol import abi
from meshd_mps.protocol.frames import DRIVER_NO_ENTRY, NoEntry


def abi_mismatch(name: str, got: int) -> AbiMismatch:
    """The refusal of a module built for another program ABI (read from the cubin or the module)."""
    return AbiMismatch(f"{name}: {abi.RT_ABI_SYMBOL} is {got}, this meshd-mps runs program ABI {abi.RT_ABI}",
                       program=name, abi=got, expected=abi.RT_ABI)


def preflight(prepared: Prepared, gpu: str, info: DeviceInfo) -> None:
    """Refuses the image as its load would, where its cubin says so; bytes that are no cubin this
    reader understands (the simulated GPU's test scripts) are left to the worker."""
    name = prepared.manifest.name
    try:
        cubin = Cubin(prepared.cubin)
    except CubinError:
        return
    if cubin.symbol(abi.ENTRY, STT_FUNC) is None:
        raise NoEntry(driver=DRIVER_NO_ENTRY, read=True).prefixed(f"load {name}")
    sym = cubin.symbol(abi.RT_ABI_SYMBOL, STT_OBJECT)
    got = 0 if sym is None else cubin.u32(sym)
    if got is not None and got != abi.RT_ABI:
        raise abi_mismatch(name, got)
    if gpu == "sim":
        from meshd_mps.gpu.examples import cubin_id, example_images
        from workers.sim_images import refusal

        known = example_images(info)
        if cubin_id(prepared.cubin) not in known:
            why = refusal(name, prepared.hash, cubin_id(prepared.cubin), known)
            raise ImageRefused(f"load {name}: {why}", driver=why)
