"""``serve --daemon-cpus`` (meshd_mps/supervision/cpus.py): the daemon's threads on its CPUs, every
child (the workers, the MPS control daemon and its server) on the others; and the CPU lists."""

from __future__ import annotations

import os

import pytest

from meshd_mps.base.errors import ConfigError
from meshd_mps.serving.client import program_body
from meshd_mps.supervision import cpus

from ..rigs.serve import EXAMPLES, assert_clean_exit

pytestmark = pytest.mark.timeout(120)


@pytest.mark.parametrize(("spec", "want"), [("3", {3}), ("2,3", {2, 3}), ("0-3,8", {0, 1, 2, 3, 8}), (" 1 , 4-5 ", {1, 4, 5}),
                                            ([2, 0], {0, 2})])
def test_cpu_lists_read_as_taskset_writes_them(spec, want):
    assert cpus.parse(spec) == want
    assert cpus.parse(cpus.text(want)) == want


@pytest.mark.parametrize(("spec", "why"), [("", "CPU numbers and ranges"), ("a", "CPU numbers and ranges"),
                                           ("1,,2", "CPU numbers and ranges"), ("-1", "CPU numbers and ranges"),
                                           ("3-1", "the range 3-1 runs backwards"), ([], "no CPU given"),
                                           ([True], "True is not a CPU number"), ([-2], "-2 is not a CPU number"),
                                           ("\u00b2", "CPU numbers and ranges"),  # a digit to str.isdigit, not to int()
                                           ("0-4000000000", "CPU 4000000000 is past any CPU"),  # refused, not expanded
                                           ([9000], "CPU 9000 is past any CPU")])
def test_a_bad_cpu_list_is_named(spec, why):
    with pytest.raises(ConfigError, match=why):
        cpus.parse(spec)


def test_text_joins_runs():
    assert cpus.text({0, 1, 2, 3, 8, 10, 11}) == "0-3,8,10-11"


def test_unplace_puts_each_thread_back_on_its_own_cpus():
    """The bench's placed phases end with ``unplace``: a thread pinned before (the floor's host, a
    driver's thread) is back on its own CPUs, not on the process's."""
    import threading

    allowed = frozenset(os.sched_getaffinity(0))
    if len(allowed) < 2:
        pytest.skip(f"needs 2 CPUs; this process may use {cpus.text(allowed)}")
    lo, hi = min(allowed), max(allowed)
    seen: dict[str, frozenset[int]] = {}
    pinned, placed, done = threading.Event(), threading.Event(), threading.Event()

    def pinned_thread() -> None:
        os.sched_setaffinity(0, {lo})
        pinned.set()
        placed.wait(30)
        seen["placed"] = frozenset(os.sched_getaffinity(0))
        done.wait(30)
        seen["after"] = frozenset(os.sched_getaffinity(0))

    t = threading.Thread(target=pinned_thread)
    t.start()
    try:
        assert pinned.wait(30)
        with cpus.placed(frozenset({hi})):
            placed.set()
            assert frozenset(os.sched_getaffinity(0)) == {hi}
            while "placed" not in seen and t.is_alive():
                t.join(0.01)
        assert frozenset(os.sched_getaffinity(0)) == allowed
    finally:
        placed.set()
        done.set()
        t.join(30)
    assert seen == {"placed": {hi}, "after": {lo}}
    assert cpus.children() is None and cpus.status() is None


def _cpus_of(pid: int) -> set[frozenset[int]]:
    """Every thread's allowed CPUs (one set each, deduplicated)."""
    out = set()
    for tid in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{tid}/status") as f:
            line = next(x for x in f if x.startswith("Cpus_allowed_list:"))
        out.add(cpus.parse(line.split(":", 1)[1].strip()))
    return out


def _children(pid: int) -> set[int]:
    kids: set[int] = set()
    for tid in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{tid}/children") as f:
            kids.update(int(k) for k in f.read().split())
    return kids


def _descendants(pid: int) -> set[int]:
    out, todo = set(), [pid]
    while todo:
        kids = _children(todo.pop()) - out
        out |= kids
        todo.extend(kids)
    return out


def test_the_daemon_keeps_its_cpus_to_itself(serve):
    allowed = frozenset(os.sched_getaffinity(0))
    if len(allowed) < 2:
        pytest.skip(f"needs 2 CPUs (one for the daemon, one for its children); this process may use {cpus.text(allowed)}")
    mine = frozenset({max(allowed)})
    rest = allowed - mine
    s = serve("mps", "--pool", "2", "--daemon-cpus", cpus.text(mine))
    status = s.wait_ready()
    s.client.load(program_body(str(EXAMPLES / "heartbeat")))  # its worker taken from the pool, one spawned after
    assert status["cpus"] == {"daemon": cpus.text(mine), "children": cpus.text(rest)}
    assert _cpus_of(s.proc.pid) == {mine}  # every thread of it, those the loop started too
    kids = _descendants(s.proc.pid)
    assert status["daemon_pid"] in kids and len(kids) >= 3  # the control daemon, two workers (and MPS's server)
    for k in kids:
        assert _cpus_of(k) == {rest}, f"child {k}"
    assert f"the daemon on CPUs {cpus.text(mine)}, its workers and MPS on {cpus.text(rest)}" in s.log()
    assert s.stop() == 0, s.log()
    assert_clean_exit(s, status["mps_dir"])
