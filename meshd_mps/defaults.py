"""The defaults that the library (``Backend.open``) and ``serve`` share, in one place.

``state/config.py``'s ``SERVE_DEFAULTS`` reads these for serve's options, and ``Backend.open``'s
signature reads them too, so that a user embedding the library and one running the daemon start
from the same mode, GPU and share of SMs.  They live in the bottom layer because both the backend
(layer 5) and the config (layer 7) read them.
"""

from __future__ import annotations

from typing import Final

#: The isolation a GPU runs in unless told: blink (one context), which needs no MPS binaries.
ISOLATION: Final = "blink"
#: The GPU: the real one (``sim`` is chosen explicitly, never as a fallback).
GPU: Final = "cuda"
#: ``--sms``: 0, no cap on a worker's share of SMs.
SMS: Final = 0
#: Idle workers kept ready on each GPU, by isolation, when serve is not told (a blink-mode program
#: runs in the one context, never in a pooled worker).  The library keeps none unless asked
#: (``Backend.open(pool=0)``): an embedding program decides what it pays for idle MPS clients.
POOL_BY_ISOLATION: Final[dict[str, int]] = {"blink": 0, "mps": 2}
