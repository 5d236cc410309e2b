"""Images for the simulated GPU (``--gpu sim``)."""

from __future__ import annotations

import json


def sim(**script) -> bytes:
    """An image for the simulated GPU: what its kernel and the worker do."""
    return b"MESHSIM1" + json.dumps(script).encode()
