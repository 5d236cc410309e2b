"""What the NVML tests share: pynvml's error classes, as a stand-in pynvml module has them."""

from __future__ import annotations


class NvmlErrors:
    """pynvml's error classes as a stand-in pynvml module has them (the ones Nvml catches)."""

    class NVMLError(Exception):
        pass

    class NVMLError_NotSupported(NVMLError):
        pass

    class NVMLError_FunctionNotFound(NVMLError):
        pass
