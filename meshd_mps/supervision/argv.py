"""A worker process's command line, the one place it is written (both modes start workers with it).

The worker starts as ``python -m workers``: its own package, no part of the daemon's CLI or
serving layer imported on the way (a worker must start fast, docs/benchmarks.md row d).
"""

from __future__ import annotations

import sys

#: Hardware work queues an MPS worker asks for: its one program's stream, and one to spare
#: (isolation/limits.py says why; the blink context asks for ``BLINK_QUEUES``).
MPS_QUEUES = 2


def worker_argv(mailbox: str, sms: int, gpu: str, device: int = 0, queues: int = MPS_QUEUES, hold: bool = False) -> list[str]:
    """A worker for this interpreter (no PATH lookup, the same venv), on GPU ``device``, asking for
    ``queues`` hardware work queues; ``hold``: its context is created at its first READY, not at start."""
    argv = [sys.executable, "-m", "workers", "--mailbox", mailbox, "--gpu", gpu, "--device", str(device),
            "--queues", str(queues)]
    if sms:
        argv += ["--sms", str(sms)]
    if hold:
        argv.append("--hold")
    if gpu == "sim":  # the simulated GPU's known images, compiled once here (gpu/examples.py), not in each worker
        from meshd_mps.gpu.device import simulated_device
        from meshd_mps.gpu.examples import as_arg

        argv += ["--examples", as_arg(simulated_device(device))]
    return argv
