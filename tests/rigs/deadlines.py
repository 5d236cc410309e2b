"""The tests' one table of deadlines (tests/conftest.py names it too): short where a test waits a
deadline out, the seed's where a reply must come."""

from __future__ import annotations

from meshd_mps.deadlines import Deadlines

#: Short retire deadlines keep hang tests quick; replies keep the seed's.
TEST_DEADLINES = Deadlines(retire_quit=1.0, retire_kill=2.0)
