"""The CUDA backend in either mode, for an asyncio host: ``await Backend.open()``, or ``async with
Backend.open() as b`` (facade.py).  Beside it, each in a module of its own: what an earlier live run
left (leftovers.py), the GPU inventory taken at open (inventory.py), MPS mode's native clients
(native.py)."""

from meshd_mps.backend.facade import Backend, IsolationName, Opening
from meshd_mps.backend.leftovers import SHM_DIR, LivePaths, live_paths
from meshd_mps.isolation.base import Evidence, Found, Image, Kernel

__all__ = ["SHM_DIR", "Backend", "Evidence", "Found", "Image", "IsolationName", "Kernel", "LivePaths", "Opening",
           "live_paths"]
