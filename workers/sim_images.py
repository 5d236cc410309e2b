"""Which shipped example a real cubin is, for the simulated GPU (workers/sim_gpu.py): by its image.

The simulation runs no GPU code; it runs the examples' device code as Python (sim_kernels.py), and
knows that a cubin is an example by LOAD's ``tag``, the image hash the daemon reports, never by the
program's name (a user's ``echo_counter`` is not echo).  The known images come from the daemon on
the worker's command line (``--examples``, meshd_mps/gpu/examples.py ``as_arg``), else are compiled
here from the shipped sources at the first real cubin; every other image is refused.
"""

from __future__ import annotations

from .gpu import GpuError


def parse(text: str) -> dict[int, str]:
    """``--examples``' ``name=hash,...`` as hash -> name."""
    out: dict[int, str] = {}
    for item in filter(None, text.split(",")):
        name, _, h = item.partition("=")
        try:
            out[int(h, 16)] = name
        except ValueError as e:
            raise GpuError(f"--examples {text!r}: name=hash (16 hex digits) expected") from e
    return out


def refusal(name: str, tag: int, known: dict[int, str]) -> str:
    """Why a real cubin is refused: the simulation runs only the shipped examples, by image."""
    images = ", ".join(f"{n} {h:016x}" for h, n in sorted(known.items(), key=lambda kv: kv[1])) or "none found here"
    return (f"simulated GPU: {name} (image {tag:016x}) is not one of the shipped examples, and the simulation does not"
            f" run GPU code: it runs only the examples, recognised by their image whatever their name ({images});"
            " check your own program without a GPU with `meshd-mps check DIR`, and run it on a GPU")


class Examples:
    """The examples' images one simulated GPU knows (``arch``: its ``compute_XY``)."""

    def __init__(self, arg: str | None, arch: str):
        self.arch = arch
        self._known = None if arg is None else parse(arg)

    def known(self) -> dict[int, str]:
        if self._known is None:  # no daemon gave them: NVRTC here, once (~0.4 s)
            from meshd_mps.gpu.examples import example_images

            self._known = example_images(self.arch)
        return self._known

    def example_of(self, name: str, tag: int) -> str:
        """The example whose image ``tag`` is; GpuError, refused (the image's fault), for any other."""
        kind = self.known().get(tag)
        if kind is None:
            raise GpuError(refusal(name, tag, self.known()), refused=True)
        return kind
