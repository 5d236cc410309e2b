"""The defaults that the library (``Backend.open``), ``serve`` and the workers share, in one place.

``state/config.py``'s ``SERVE_DEFAULTS`` reads these for serve's options, and ``Backend.open``'s
signature reads them too, so that a user embedding the library and one running the daemon start
from the same mode, GPU and share of SMs.  They live in the bottom layer because both the backend
(layer 5) and the config (layer 7) read them.
"""

from __future__ import annotations

import os
from typing import Final

#: The isolation a GPU runs in unless told: blink (one context), which needs no MPS binaries.
ISOLATION: Final = "blink"
#: The GPU: the real one (``sim`` is chosen explicitly, never as a fallback).
GPU: Final = "cuda"
#: ``--sms``: 0, no cap on a worker's share of SMs.
SMS: Final = 0
#: Idle workers kept ready on each GPU, by isolation, when serve is not told (a blink-mode program
#: runs in the one context, never in a pooled worker).  MPS mode's 4: the pool's reserve (kept for
#: upgrades) and three loads, so that a new user's first loads and upgrades make no MPS client after
#: the start (each would stall every running program once).  The library keeps none unless asked
#: (``Backend.open(pool=0)``): an embedding program decides what it pays for idle MPS clients.
POOL_BY_ISOLATION: Final[dict[str, int]] = {"blink": 0, "mps": 4}

#: The control socket unless ``--socket`` is given: the daemon's and the client's (serving/client.py).
SOCKET_ENV: Final = "MESHD_MPS_SOCKET"
#: The name of the default socket (``NAME.sock``) and state directory: the GPU's, and for the
#: simulated GPU its own (``meshd-mps-sim``), so that trying ``--gpu sim`` never shares the real
#: service's socket or desired state (a program loaded on the sim would be restored on the GPU).
NAME: Final = "meshd-mps"
NAME_BY_GPU: Final[dict[str, str]] = {"cuda": NAME, "sim": f"{NAME}-sim"}


def named(gpu: str | None) -> str:
    """The default socket's and state directory's name for ``gpu`` (None: the default GPU's)."""
    return NAME_BY_GPU[gpu or GPU]


#: The log's level unless told (``--log-level``): the daemon's and, inherited, its workers'.
LOG_LEVEL_ENV: Final = "MESHD_MPS_LOG_LEVEL"
#: The format the daemon chose (json | console), set in its environment for its workers
#: (workers/wlog.py): a worker's stderr is the daemon's, and one stream has one format.
LOG_FORMAT_ENV: Final = "MESHD_MPS_LOG_FORMAT"


def log_level(asked: str | None) -> str:
    """The level's name (INFO, ...): ``asked``, else ``$MESHD_MPS_LOG_LEVEL``, else info; read here
    by meshd_mps/base/log.py and workers/wlog.py alike (this module imports nothing that is slow)."""
    return (asked or os.environ.get(LOG_LEVEL_ENV, "info")).upper()
