"""One ``meshd-mps worker`` process spoken to frame by frame over its pipes, with no supervisor:
the rig of tests/rig/test_sim_limits.py (``--gpu sim``) and tests/gpu/test_cuda_worker.py
(``--gpu cuda``), so that both read frames, and fail, the same way.

Replies are taken in order from a queue; DONEs, which come whenever a kernel ends, are collected
on the side.  With ``logs`` the worker's stderr, JSON lines, is read into ``logs`` for
``logged``; without, it goes where the test's does.
"""

from __future__ import annotations

import contextlib
import json
import queue
import subprocess
import sys
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from meshd_mps.protocol import frames
from meshd_mps.protocol.frames import Done, LaunchReq, Load, Loaded, Op
from meshd_mps.protocol.mailbox import Mailbox

from .waits import poll

ROOT = Path(__file__).resolve().parents[2]


class Worker:
    """A worker on ``mailbox`` driving ``gpu`` (``sim`` or ``cuda``); ``args``: more of its options.
    ``reply_within``: seconds a reply may take before the test fails naming it."""

    def __init__(self, mailbox: Mailbox, gpu: str, *args: str, env: Mapping[str, str] | None = None,
                 logs: bool = False, reply_within: float = 60):
        argv = [sys.executable, "-m", "meshd_mps", "worker", "--mailbox", mailbox.path, "--gpu", gpu, *args]
        self.p = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE if logs else None, pass_fds=(mailbox.fd,), cwd=ROOT, env=env)
        self.reply_within = reply_within
        self.replies: queue.Queue[tuple[Op, bytes] | None] = queue.Queue()
        self.dones: dict[tuple[int, int], Done] = {}
        self.logs: list[dict[str, Any]] = []
        self.cv = threading.Condition()
        self._threads = [threading.Thread(target=self._read, daemon=True)]
        if logs:
            self._threads.append(threading.Thread(target=self._err, daemon=True))
        for t in self._threads:
            t.start()

    def _read(self) -> None:
        out = self.p.stdout
        assert out is not None
        try:
            while len(head := out.read(frames.HEADER.size)) == frames.HEADER.size:
                (n,) = frames.HEADER.unpack(head)
                rest = out.read(n)
                if len(rest) < n:
                    break
                op, body = Op(rest[0]), rest[1:]
                if op == Op.DONE:
                    d = Done.decode(body)
                    with self.cv:
                        self.dones[(d.module, d.gen)] = d
                        self.cv.notify_all()
                else:
                    self.replies.put((op, body))
        except Exception as e:  # reported by the test waiting for a reply
            self.replies.put((Op.QUIT, f"reader: {e!r}".encode()))
        self.replies.put(None)

    def _err(self) -> None:
        assert self.p.stderr is not None
        for line in self.p.stderr:
            try:
                self.logs.append(json.loads(line))
            except ValueError:
                self.logs.append({"msg": line.decode(errors="replace")})

    # ---- requests -----------------------------------------------------------------------

    def send(self, op: Op, body: bytes = b"") -> None:
        assert self.p.stdin is not None
        self.p.stdin.write(frames.encode(op, body))
        self.p.stdin.flush()

    def ask(self, op: Op, body: bytes, want: Op) -> tuple[bool, bytes]:
        ok, payload = self.ask_word(op, body, want)
        return ok == frames.OK, payload

    def ask_word(self, op: Op, body: bytes, want: Op) -> tuple[int, bytes]:
        """The reply's ok word itself (LOADED has three) and its payload."""
        self.send(op, body)
        try:
            got = self.replies.get(timeout=self.reply_within)
        except queue.Empty:
            raise AssertionError(f"no {want.name} within {self.reply_within:g} s") from None
        assert got is not None, f"the worker closed stdout (exit {self.p.poll()}) instead of {want.name}"
        rop, rbody = got
        assert rop == want, f"{rop.name} {rbody!r} instead of {want.name}"
        return frames.split_reply(rop, rbody)

    def ready(self) -> int:
        ok, payload = self.ask(Op.READY, b"", Op.READY)
        assert ok, frames.reply_text(payload)
        return frames.ready_pid(payload)

    def load(self, req: Load) -> Loaded:
        ok, payload = self.ask(Op.LOAD, req.encode(), Op.LOADED)
        assert ok, frames.reply_text(payload)
        return Loaded.decode_ok(payload)

    def load_error(self, req: Load, word: int = frames.FAILED) -> str:
        """The text of a LOAD that fails with ok word ``word`` (REFUSED: the image's fault)."""
        ok, payload = self.ask_word(Op.LOAD, req.encode(), Op.LOADED)
        assert ok == word, f"LOADED ok word {ok}, expected {word}: {frames.reply_text(payload)}"
        return frames.reply_text(payload)

    def launch(self, module: int, gen: int, slot: int, nodes: int = 1) -> None:
        ok, payload = self.ask(Op.LAUNCH, LaunchReq(module, gen, slot, nodes).encode(), Op.LAUNCHED)
        assert ok, frames.reply_text(payload)

    def unload(self, module: int) -> None:
        self.send(Op.UNLOAD, frames.unload_body(module))

    # ---- what came back on the side -----------------------------------------------------

    def done(self, module: int, gen: int, timeout: float = 10) -> Done:
        end = time.monotonic() + timeout
        with self.cv:
            while (module, gen) not in self.dones:
                left = end - time.monotonic()
                assert left > 0, f"no DONE for module {module} gen {gen} within {timeout} s"
                self.cv.wait(left)
            return self.dones[(module, gen)]

    def logged(self, **fields: Any) -> dict[str, Any]:
        """The first log line with all of ``fields`` (the worker started with ``logs``)."""
        return poll(lambda: next((e for e in list(self.logs) if fields.items() <= e.items()), None), 10,
                    f"a log line with {fields}")

    # ---- the end ------------------------------------------------------------------------

    def quit(self, timeout: float = 20) -> int:
        """QUIT; the exit status, or a failure (after a kill) if it does not exit within ``timeout``."""
        with contextlib.suppress(OSError):  # it exited already
            self.send(Op.QUIT)
        try:
            rc = self.p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.p.kill()
            self.p.wait()
            raise AssertionError(f"the worker did not exit within {timeout} s of QUIT") from None
        finally:
            self.close_pipes()
        return rc

    def kill(self) -> None:
        if self.p.poll() is None:
            self.p.kill()
            self.p.wait()
        self.close_pipes()

    def close(self) -> None:
        """A fixture's teardown: QUIT if it still runs, killed whatever happens, the pipes closed."""
        try:
            if self.p.poll() is None:
                self.quit()
        finally:
            self.kill()

    def close_pipes(self) -> None:
        """After the exit: its readers end at EOF, then every pipe is closed."""
        for t in self._threads:
            t.join(timeout=5)
        for f in (self.p.stdin, self.p.stdout, self.p.stderr):
            if f is not None:
                with contextlib.suppress(OSError):  # stdin's unflushed bytes meet a closed pipe
                    f.close()
