"""Which shipped example a real cubin is, for the simulated GPU (workers/sim_gpu.py): by its image.

The simulation runs no GPU code; it runs the examples' device code as Python (sim_kernels.py), and
knows that a cubin is an example by the cubin itself, the image the driver would load (its
sha256, meshd_mps/gpu/examples.py ``cubin_id``), never by the program's name (a user's
``echo_counter`` is not echo) nor by LOAD's ``tag`` (the hash of the PTX: a comment added changes
it, not the code).  The known cubins come from the daemon on the worker's command line
(``--examples``, examples.py ``as_arg``), else are compiled here from the shipped sources at the
first real cubin; every other cubin is refused.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .gpu import GpuError

if TYPE_CHECKING:
    from meshd_mps.gpu.device import DeviceInfo


def parse(text: str) -> dict[int, str]:
    """``--examples``' ``name=cubin id,...`` as cubin id -> name."""
    out: dict[int, str] = {}
    for item in filter(None, text.split(",")):
        name, _, h = item.partition("=")
        try:
            out[int(h, 16)] = name
        except ValueError as e:
            raise GpuError(f"--examples {text!r}: name=cubin id (16 hex digits) expected") from e
    return out


def refusal(name: str, tag: int, cubin: int, known: dict[int, str]) -> str:
    """Why a real cubin is refused: the simulation runs only the shipped examples, by their cubin.  It
    names the image in the two words every surface uses: its ``hash`` (the PTX's, as ``load``, ``ps``
    and ``check`` show it) and its ``cubin`` (the compiled image's id, as ``check`` shows it too)."""
    images = ", ".join(f"{n} {h:016x}" for h, n in sorted(known.items(), key=lambda kv: kv[1])) or "none found here"
    return (f"simulated GPU: {name} (hash {tag:016x}, cubin {cubin:016x}) is not one of the shipped examples, and"
            f" the simulation does not run GPU code: it runs only the examples, recognised by their cubin whatever"
            f" their name (the examples' cubins: {images}); `meshd-mps check DIR` shows your program's hash and"
            " cubin and checks it without a GPU; run it on a GPU")


class Examples:
    """The examples' cubins one simulated GPU (``info``) knows."""

    def __init__(self, arg: str | None, info: DeviceInfo):
        self.info = info
        self._known = None if arg is None else parse(arg)

    def known(self) -> dict[int, str]:
        if self._known is None:  # no daemon gave them: NVRTC and nvJitLink here, once (~0.5 s)
            from meshd_mps.gpu.examples import example_images

            self._known = example_images(self.info)
        return self._known

    def example_of(self, name: str, tag: int, cubin: bytes) -> str:
        """The example ``cubin`` is; GpuError, refused (the image's fault), for any other (``tag``,
        the load's image hash, only to name it as the user knows it)."""
        from meshd_mps.gpu.examples import cubin_id

        got = cubin_id(cubin)
        kind = self.known().get(got)
        if kind is None:
            raise GpuError(refusal(name, tag, got, self.known()), refused=True)
        return kind
