"""A real terminal for what a person sees (``meshd-mps top``): a tmux server of the test's own
(its socket in the test's directory), one window of a fixed size running the command, its screen
captured as text (``capture-pane``) and keys sent to it (``send-keys``)."""

from __future__ import annotations

import os
import shlex
import subprocess
from collections.abc import Callable

from .serve import env, reap
from .waits import poll

SESSION = "see"


def _env() -> dict[str, str]:
    """The serve rig's environment less COLUMNS and LINES, which a pytest-xdist worker sets (80, 24)
    and a program on Rich takes over its terminal's size: the window's size is the terminal's."""
    return {k: v for k, v in env().items() if k not in ("COLUMNS", "LINES")}


class Tmux:
    def __init__(self, tmux: str, dir: str, cols: int = 200, rows: int = 50):
        self.tmux, self.cols, self.rows = tmux, cols, rows
        self.sock = os.path.join(dir, "tmux.sock")
        self.started = False

    def _run(self, *args: str) -> str:
        r = subprocess.run([self.tmux, "-S", self.sock, *args], capture_output=True, text=True, timeout=30, env=_env())
        assert r.returncode == 0, f"tmux {' '.join(args)}: {r.stderr}"
        return r.stdout

    def start(self, argv: list[str]) -> None:
        """``argv`` in the window; then ``exited N`` once it ends (its exit status), and the window stays."""
        line = f"{shlex.join(argv)}; echo exited $?; sleep 600"
        self.started = True
        self._run("-f", "/dev/null", "new-session", "-d", "-s", SESSION, "-x", str(self.cols), "-y", str(self.rows), line)

    def screen(self) -> str:
        return self._run("capture-pane", "-p", "-t", SESSION)

    def keys(self, *keys: str) -> None:
        self._run("send-keys", "-t", SESSION, *keys)

    def wait_for(self, cond: Callable[[str], object], what: str, within: float = 30.0) -> str:
        """The screen once ``cond(screen)`` holds; a failure names ``what`` and shows the screen."""
        seen = {"screen": ""}

        def look() -> object:
            seen["screen"] = self.screen()
            return cond(seen["screen"])

        poll(look, within, lambda: f"{what}; the screen:\n{seen['screen']}", every=0.1)
        return seen["screen"]

    def close(self) -> None:
        """The server killed (its window's processes hung up), and reaped: the test process is a
        subreaper (conftest), so the server it started, a daemon, and what its window ran are ours."""
        if not self.started:
            return
        self.started = False
        got = subprocess.run([self.tmux, "-S", self.sock, "display-message", "-p", "-t", SESSION, "#{pid} #{pane_pid}"],
                             capture_output=True, text=True, timeout=30, env=_env())
        subprocess.run([self.tmux, "-S", self.sock, "kill-server"], capture_output=True, timeout=30, env=_env())
        reap([int(p) for p in got.stdout.split()])  # none where the server never started
