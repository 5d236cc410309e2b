"""The shipped example programs (examples/heartbeat, echo, spin, fault) and their images.

The simulated GPU (``--gpu sim``) runs no GPU code: it runs these examples' device code as
Python (workers/sim_kernels.py), so it must know that a cubin *is* one of them.  It knows by the
image, the hash the daemon reports for a load (``compiler.image_hash`` of the PTX and ``param``,
sent to the worker as LOAD's ``tag``), never by the program's name: a user's ``echo_counter`` is
not echo.  The hashes are not written down here: PTX changes with every NVRTC release, so they
are derived at run time from the example sources this package ships, compiled as ``meshd-mps
load examples/NAME`` compiles them (``cuda_to_ptx``, the example's folder on the include path, the
arch asked for), once per process and arch: ~0.4 s of NVRTC, which the daemon spends once and
hands to each simulated worker on its command line (``--examples``, ``as_arg``), so that a worker
started for one load does not spend it again.
"""

from __future__ import annotations

import functools
from pathlib import Path

from meshd_mps.gpu.compiler import Manifest, cuda_to_ptx, image_hash

#: The examples folder of a source checkout (the wheel ships none: then nothing is recognised).
EXAMPLES_DIR = Path(__file__).resolve().parents[2] / "examples"
#: The examples the simulation runs, by name (each is a kernel of workers/sim_gpu.py).
NAMES = ("heartbeat", "echo", "spin", "fault")


@functools.cache
def example_images(arch: str = "compute_90") -> dict[int, str]:
    """Image hash -> example name, for the shipped examples compiled for ``arch`` (``compute_XY``).
    An example that cannot be read or compiled here (no checkout, no NVRTC) is left out: the
    simulation then refuses its images as it refuses any other, saying which it knows."""
    out: dict[int, str] = {}
    for name in NAMES:
        d = EXAMPLES_DIR / name
        try:
            m = Manifest.parse((d / "manifest.json").read_bytes())
            ptx = cuda_to_ptx((d / f"{name}.cu").read_bytes(), name, arch, [str(d)])
        except Exception:  # OSError, ManifestError, CompileError, NVRTC missing: not known here
            continue
        out[image_hash(ptx, m.param)] = name
    return out


def as_arg(arch: str = "compute_90") -> str:
    """The known images as a sim worker's ``--examples``: ``name=hash`` (16 hex digits), comma-separated
    (workers/sim_gpu.py ``parse_examples`` reads it)."""
    return ",".join(f"{n}={h:016x}" for h, n in sorted(example_images(arch).items(), key=lambda kv: kv[1]))
