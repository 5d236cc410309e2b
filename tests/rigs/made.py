"""The MPS clients made, as the stand-in control daemon's ``control.log`` says them ("New client
PID connected"), in order with the kernels it sees start ("Client PID kernel running"): each new
client stalls every running program of its GPU once on the GPU, so the tests count them."""

from __future__ import annotations

import os
import re
import subprocess

from meshd_mps.standin import BIN_DIR

_LINE = re.compile(r"(New client (\d+) connected|Client (\d+) kernel running)")


class MadeClients:
    """``control.log`` of the stand-in daemon of ``mps_dir``, read from a mark on."""

    def __init__(self, mps_dir: str):
        self.path = os.path.join(mps_dir, "log", "control.log")
        self.pipe = os.path.join(mps_dir, "pipe")
        self.at = 0

    def _lines(self) -> list[str]:
        try:
            with open(self.path, errors="replace") as f:
                return f.read().splitlines()
        except FileNotFoundError:
            return []

    def mark(self) -> None:
        """What is logged from now on is what ``since`` reads."""
        self.at = len(self._lines())

    def settle(self) -> None:
        """Two control commands' round trips: a client's HELLO already written (by a process
        stopped since, say) has been taken by the daemon when they return, so a ``mark`` after this
        counts only what comes later.  (Each command is a round of the daemon's loop, which takes
        every socket ready in it.)"""
        env = {**os.environ, "CUDA_MPS_PIPE_DIRECTORY": self.pipe}
        control = os.path.join(BIN_DIR, "nvidia-cuda-mps-control")
        for _ in range(2):
            subprocess.run([control], input="get_server_list\n", env=env, capture_output=True, text=True, timeout=30,
                           check=True)

    def since(self) -> list[tuple[str, int]]:
        """("new", pid) for each client made and ("running", pid) for each kernel seen starting, in
        the order the daemon saw them, since the mark."""
        out = []
        for line in self._lines()[self.at:]:
            if m := _LINE.search(line):
                out.append(("new", int(m.group(2))) if m.group(2) else ("running", int(m.group(3))))
        return out

    def made(self) -> list[int]:
        """The clients made since the mark."""
        return [pid for what, pid in self.since() if what == "new"]
