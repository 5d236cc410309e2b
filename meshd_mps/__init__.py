"""meshd-mps: resident CUDA kernels, one NVIDIA MPS client process each.

``await Backend.open(...)`` is the embedding API (docs/api.md); ``Programs``
is the layer of named programs on mailbox slots that ``meshd-mps serve`` uses.
Imports are lazy so that ``meshd-mps worker`` starts without the supervisor.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__all__ = ["Backend", "Deadlines", "Launch", "MeshError", "Programs", "__version__"]

if TYPE_CHECKING:
    from meshd_mps.backend import Backend
    from meshd_mps.base.deadlines import Deadlines
    from meshd_mps.base.errors import MeshError
    from meshd_mps.isolation.launch import Launch
    from meshd_mps.programs import Programs

_WHERE = {"Backend": "backend", "Programs": "programs", "Launch": "isolation.launch", "Deadlines": "base.deadlines",
          "MeshError": "base.errors"}


def __getattr__(name: str) -> Any:
    if name == "__version__":  # read in one place, when asked (meshd_mps/base/version.py)
        from meshd_mps.base.version import version

        return version()
    if name in _WHERE:
        import importlib

        return getattr(importlib.import_module(f".{_WHERE[name]}", __name__), name)
    raise AttributeError(f"module 'meshd_mps' has no attribute {name!r}")
