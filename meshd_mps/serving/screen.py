"""The full-screen live view that ``meshd-mps top`` and ``meshd-mps fleet top`` share: a frame of
tables redrawn every second (as ``top``, ``nvtop``, ``docker stats``), its keys (sort, filter by
name, quit) and its terminal, on Rich's live display.

Why Rich and not Textual: the view is tables redrawn from a poll, three keys and one line of input;
Rich draws them (``Live`` on the terminal's alternate screen, ``Table``), and the keys are read
here in the terminal's cbreak mode on the event loop (``add_reader``), 40 lines.  Textual's app
framework (its own driver, CSS, widgets and message loop) would take the loop and the terminal
for what that does.  Rich is an optional extra (``pip install 'meshd-mps[top]'``): the node's
other commands never import it.

A frame is made by its command (serving/top.py, fleet/top.py) from what it polled: a header line,
sections (titled tables of cells, each cell its text and the value it sorts by) and the latest
events.  The first section is the one the keys sort and filter (by its first column).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
import termios
import time
import tty
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from meshd_mps.base.errors import ConfigError

#: How often the frame is polled and redrawn (s): a poll interval, not a deadline.
EVERY_S = 1.0
#: The events kept on the screen, newest last.
EVENTS = 8
HELP = "s sort  r reverse  / filter  q quit"
#: ``--once``'s width where its output is no terminal (a log, a pipe): no table cut short.
WIDE = 250
EXTRA_HINT = "pip install 'meshd-mps[top]' (Rich, the terminal view)"


class Cell:
    """A table cell: its text, and the value it sorts by (None sorts last)."""

    __slots__ = ("key", "text")

    def __init__(self, text: str, key: Any = None):
        self.text, self.key = text, key


@dataclass
class Section:
    title: str
    head: list[str]
    rows: list[list[Cell]]
    right: frozenset[int] = frozenset()  # the columns of figures, right-aligned
    empty: str = "(none)"
    filtered: bool = False  # the name filter applies to it (by its first column); the first section's always does


@dataclass
class Frame:
    header: str
    sections: list[Section]
    events: list[str] = field(default_factory=list)
    error: str | None = None  # why this look failed (the last good frame's tables stay)


def need_rich() -> Any:
    """The ``rich`` package, or ConfigError saying how to install it (the ``top`` extra)."""
    try:
        import rich
    except ImportError as e:
        raise ConfigError(f"top needs Rich, which is not installed: {EXTRA_HINT}") from e
    return rich


def view_of(sort: str | None, reverse: bool, filter: str | None, interval: float, head: list[str]) -> View:
    """The view ``top --sort --reverse --filter --interval`` asks for, its first section's columns
    ``head``; ConfigError (exit 2) for a column it does not have or an interval that is not one."""
    column = sort.upper() if sort else None
    if column is not None and column not in head:
        raise ConfigError(f"top --sort {sort}: one of {', '.join(h.lower() for h in head)}")
    if not interval > 0:
        raise ConfigError("top --interval: seconds, more than 0")
    return View(sort=column, reverse=reverse, filter=filter or "")


class View:
    """What the keys choose (the column sorted by, its direction, the name filter) and the
    rendering of a frame with them.  ``view.key(ch)`` takes a key; False means quit."""

    def __init__(self, sort: str | None = None, reverse: bool = False, filter: str = ""):
        self.sort, self.reverse, self.filter = sort, reverse, filter
        self.typing: str | None = None  # the filter being typed after '/', until Enter or Esc
        self.events: list[str] = []
        self._next_sort = 0  # 's' pressed this often: the next column, once the frame's columns are known

    def key(self, ch: str) -> bool:
        if self.typing is not None:
            if ch in ("\r", "\n"):
                self.filter, self.typing = self.typing, None
            elif ch == "\x1b":  # Esc: no filter
                self.filter, self.typing = "", None
            elif ch in ("\x7f", "\b"):
                self.typing = self.typing[:-1]
            elif ch.isprintable():
                self.typing += ch
            return True
        if ch in ("q", "Q"):
            return False
        if ch == "/":
            self.typing = ""
        elif ch == "s":
            self._next_sort += 1
        elif ch == "r":
            self.reverse = not self.reverse
        return True

    def shown(self, s: Section) -> list[list[Cell]]:
        """A section's rows that the name filter lets through."""
        return [r for r in s.rows if self.filter.lower() in r[0].text.lower()]

    def main_rows(self, s: Section) -> list[list[Cell]]:
        """The first section's rows, filtered by name and sorted as chosen."""
        if self._next_sort:  # the column after the one sorted by (the first when none is), once per 's'
            i = s.head.index(self.sort) if self.sort in s.head else 0
            self.sort, self._next_sort = s.head[(i + self._next_sort) % len(s.head)], 0
        rows = self.shown(s)
        col = s.head.index(self.sort) if self.sort in s.head else 0
        present = [r for r in rows if r[col].key is not None]
        absent = [r for r in rows if r[col].key is None]
        present.sort(key=lambda r: (r[col].key, r[0].text), reverse=self.reverse)
        return present + absent

    def render(self, frame: Frame) -> Any:
        from rich.console import Group
        from rich.table import Table
        from rich.text import Text

        parts: list[Any] = [Text(frame.header, style="bold")]
        if frame.error:
            parts.append(Text(f"! {frame.error}", style="bold red"))
        for n, s in enumerate(frame.sections):
            rows = self.main_rows(s) if n == 0 else self.shown(s) if s.filtered else s.rows
            title = s.title
            if n == 0:
                title += f"  sort {self.sort or s.head[0]} {'v' if self.reverse else '^'}"
                if self.typing is not None:
                    title += f"  filter: {self.typing}_"
                elif self.filter:
                    title += f"  filter: {self.filter}"
            t = Table(title=title, title_justify="left", title_style="bold cyan", box=None, pad_edge=False,
                      header_style="bold reverse", expand=False)
            for i, h in enumerate(s.head):
                t.add_column(h, justify="right" if i in s.right else "left", no_wrap=True)
            for r in rows:
                t.add_row(*(c.text for c in r))
            parts += [Text(""), t]
            if not rows:
                parts.append(Text("(none match the filter)" if s.rows else s.empty, style="dim"))
        parts += [Text(""), Text("EVENTS", style="bold cyan")]
        parts += [Text(e) for e in self.events[-EVENTS:]] or [Text("(none yet)", style="dim")]
        parts += [Text(""), Text(HELP, style="dim")]
        return Group(*parts)

    def take(self, frame: Frame) -> None:
        """The frame's new events (each with its time) kept, the latest EVENTS."""
        self.events = (self.events + frame.events)[-EVENTS:]


@contextlib.contextmanager
def cbreak(fd: int) -> Iterator[bool]:
    """The terminal of ``fd`` in cbreak mode (keys one at a time, unechoed; Ctrl-C still a
    signal), restored after; False (and nothing changed) where ``fd`` is not a terminal."""
    if not os.isatty(fd):
        yield False
        return
    old = termios.tcgetattr(fd)
    try:
        tty.setcbreak(fd)
        yield True
    finally:
        termios.tcsetattr(fd, termios.TCSADRAIN, old)


async def run(view: View, look: Callable[[], Awaitable[Frame]], every: float = EVERY_S, once: bool = False) -> int:
    """The live view: ``look()`` each ``every`` seconds and the frame drawn, keys taken between
    (a key redraws at once) until ``q`` or Ctrl-C; with ``once``, one frame printed as text."""
    from rich.console import Console
    from rich.live import Live

    console = Console()
    frame = await look()
    view.take(frame)
    if once:  # into a file or a pipe: as wide as the tables are, not the 80 columns Rich assumes there
        Console(width=None if console.is_terminal else WIDE).print(view.render(frame))
        return 0
    loop = asyncio.get_running_loop()
    keys: asyncio.Queue[str] = asyncio.Queue()
    fd = sys.stdin.fileno()
    with cbreak(fd) as reading, Live(view.render(frame), console=console, screen=True, auto_refresh=False) as live:
        def readable() -> None:
            got = os.read(fd, 32)
            if got:
                keys.put_nowait(got.decode(errors="replace"))
            else:  # the terminal gone: no more keys (Ctrl-C or a signal ends the view)
                loop.remove_reader(fd)

        if reading:
            loop.add_reader(fd, readable)
        try:
            due = time.monotonic() + every
            while True:
                try:
                    got = await asyncio.wait_for(keys.get(), max(0.0, due - time.monotonic()))
                except TimeoutError:
                    frame = await look()
                    view.take(frame)
                    due = time.monotonic() + every
                else:
                    if not all(view.key(ch) for ch in got):
                        return 0
                live.update(view.render(frame), refresh=True)
        finally:
            if reading:
                loop.remove_reader(fd)
