"""The GPUs a backend drives, taken once at open: which ones (checked against those visible), their
figures and caps, and a compiler each (GPUs of one kind share one, so one cubin cache)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field

import anyio
import structlog

from meshd_mps.gpu.compiler import Compiler
from meshd_mps.gpu.device import (
    Caps,
    DeviceInfo,
    caps_of,
    check_sms,
    choose_devices,
    device_count,
    ordinals_text,
    query_device,
    simulated_count,
    simulated_device,
)
from meshd_mps.gpu.examples import example_images

log = structlog.get_logger("meshd_mps")


@dataclass
class Inventory:
    devices: tuple[int, ...] = ()  # the GPUs driven, ascending
    infos: dict[int, DeviceInfo] = field(default_factory=dict)
    caps: dict[int, Caps] = field(default_factory=dict)
    compilers: dict[int, Compiler] = field(default_factory=dict)


async def inventory(gpu: str, asked: Sequence[int] | None, sms: int, cache_dir: str | None) -> Inventory:
    """The GPUs ``asked`` (None: every visible one) of ``gpu`` (cuda or sim), each checked to have
    ``sms`` SMs to give a green context (0: the whole device)."""
    visible = simulated_count() if gpu == "sim" else await anyio.to_thread.run_sync(device_count)
    inv = Inventory(choose_devices(asked, visible))
    several = len(inv.devices) > 1
    for d in inv.devices:
        info = simulated_device(d) if gpu == "sim" else await anyio.to_thread.run_sync(query_device, d)
        if gpu == "sim":  # the examples the simulated GPU knows, compiled off the loop once (worker_argv reads them)
            await anyio.to_thread.run_sync(example_images, info)
        check_sms(info, sms, f"GPU {d}" if several else "the device")
        inv.infos[d] = info
        inv.caps[d] = caps_of(info, sms)
        # GPUs of the same kind share one compiler, so one cubin cache: a JIT once per kind.
        same = next((c for c in inv.compilers.values() if dataclasses.replace(c.info, ordinal=0)
                     == dataclasses.replace(info, ordinal=0)), None)
        inv.compilers[d] = same or Compiler(info, cache_dir)
    log.info(f"GPUs {ordinals_text(inv.devices)} of {visible} visible: "
             + ", ".join(f"{d}: {inv.infos[d].name} ({inv.infos[d].arch}, {inv.infos[d].sms_total} SMs)"
                         for d in inv.devices))
    return inv
