"""The desired state on disk (``meshd_mps/state/store.py``): where it lives, who may own it, and
that no torn, corrupt or half-written file ever loses the previous good state."""

from __future__ import annotations

import dataclasses
import json
import os
import stat
import time

import pytest
from structlog.testing import capture_logs

from meshd_mps.base.errors import StateDirRefused, StateFileNewer, StateIOError
from meshd_mps.state import store as S
from meshd_mps.state.store import ProgramRecord, Store, check_state_dir, open_state_dir, ptx_key, resolve_state_dir

PTX = b"// a PTX of program one\n.version 8.0\n"
PTX2 = b"// a PTX of program two\n.version 8.0\n"


def rec(name: str, ptx: bytes = PTX, slot: int = 0, **kw: object) -> ProgramRecord:
    base: dict[str, object] = dict(name=name, manifest={"name": name, "backend": "cuda", "warps": 1, "abi": 1},
                                   ptx_key=ptx_key(ptx), slot=slot, nodes=1, device=0, restart="on-failure",
                                   hash="0123456789abcdef", recorded_at=time.time())
    base.update(kw)
    return ProgramRecord(**base)  # type: ignore[arg-type]


@pytest.fixture
def sdir(tmp_path):
    return open_state_dir(str(tmp_path / "state"))


# ---- where -------------------------------------------------------------------------------------


def test_resolution_order(tmp_path):
    env = {"STATE_DIRECTORY": "/sd/one:/sd/two", "XDG_STATE_HOME": "/xdg", "HOME": "/home/u"}
    assert resolve_state_dir(str(tmp_path / "given"), env, uid=1000) == str(tmp_path / "given")
    assert resolve_state_dir("rel", {}, uid=1000) == os.path.abspath("rel")
    assert resolve_state_dir(None, env, uid=1000) == "/sd/one"  # systemd's, the first of several
    assert resolve_state_dir(None, env, uid=0) == "/sd/one"
    env.pop("STATE_DIRECTORY")
    assert resolve_state_dir(None, env, uid=1000) == "/xdg/meshd-mps"
    assert resolve_state_dir(None, env, uid=0) == "/var/lib/meshd-mps"
    assert resolve_state_dir(None, {"HOME": "/home/u"}, uid=1000) == "/home/u/.local/state/meshd-mps"
    # a relative $XDG_STATE_HOME is invalid by the XDG spec: ignored
    assert resolve_state_dir(None, {"HOME": "/home/u", "XDG_STATE_HOME": "x"}, uid=1000) == "/home/u/.local/state/meshd-mps"
    assert resolve_state_dir(None, {"STATE_DIRECTORY": "", "HOME": "/h"}, uid=5) == "/h/.local/state/meshd-mps"


# ---- who may own it ----------------------------------------------------------------------------


def test_made_0700(tmp_path):
    old = os.umask(0)
    try:
        d = open_state_dir(str(tmp_path / "a" / "state"))
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(d).st_mode) == 0o700
    assert os.path.isdir(os.path.join(d, "ptx"))


def test_another_owner_is_refused(tmp_path):
    d = tmp_path / "theirs"
    d.mkdir(mode=0o700)
    me = os.geteuid()
    if me == 0:  # really another owner
        os.chown(d, 4242, 4242)
        kw: dict[str, int] = {}
        owner = 4242
    else:  # the daemon as another uid: the directory is not its own
        kw = {"uid": me + 1}
        owner = me
    with pytest.raises(StateDirRefused) as ei:
        open_state_dir(str(d), **kw)
    assert ei.value.owner == owner and ei.value.path == str(d)
    assert f"owned by uid {owner}" in ei.value.why


@pytest.mark.parametrize(("mode", "who"), [(0o770, "its group"), (0o707, "other users"), (0o777, "its group and other users")])
def test_group_or_world_writable_is_refused(tmp_path, mode, who):
    d = tmp_path / "open"
    d.mkdir()
    os.chmod(d, mode)
    with pytest.raises(StateDirRefused) as ei:
        open_state_dir(str(d))
    assert f"writable by {who}" in ei.value.why and f"mode {mode:04o}" in ei.value.why


def test_symlink_to_a_bad_dir_is_refused_to_a_good_one_followed(tmp_path):
    bad = tmp_path / "bad"
    bad.mkdir()
    os.chmod(bad, 0o777)
    (tmp_path / "link").symlink_to(bad)
    with pytest.raises(StateDirRefused) as ei:
        open_state_dir(str(tmp_path / "link"))
    assert "through the symlink" in ei.value.why
    good = tmp_path / "good"
    good.mkdir(mode=0o700)
    (tmp_path / "ok").symlink_to(good)
    assert open_state_dir(str(tmp_path / "ok")) == str(tmp_path / "ok")
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
    with pytest.raises(StateDirRefused, match="dangling"):
        open_state_dir(str(tmp_path / "dangling"))


def test_check_on_stat_results(tmp_path):
    """The pure check, on the stat results it refuses: a symlink of another user's, not a dir."""
    real = os.stat(tmp_path)
    link = os.stat_result((stat.S_IFLNK | 0o777, 0, 0, 1, 4242, 4242, 0, 0, 0, 0))
    with pytest.raises(StateDirRefused) as ei:
        check_state_dir("/x", link, real, real.st_uid)
    assert ei.value.owner == 4242 and "symlink owned by uid 4242" in ei.value.why
    file = os.stat_result((stat.S_IFREG | 0o600, 0, 0, 1, real.st_uid, 0, 0, 0, 0, 0))
    with pytest.raises(StateDirRefused, match="not a directory"):
        check_state_dir("/x", file, file, real.st_uid)


def test_a_second_store_on_one_dir_is_refused(sdir):
    with Store(sdir), pytest.raises(StateDirRefused, match="another meshd-mps"):
        Store(sdir)
    Store(sdir).close()  # released


# ---- records -----------------------------------------------------------------------------------


def test_record_forget_reload(sdir):
    with Store(sdir) as s:
        assert s.programs() == {} and s.generation == 0
        a = rec("one", slot=3)
        s.record(a, PTX)
        s.record(rec("two", PTX2, slot=4, restart="always", device=1), PTX2)
        assert s.ptx(a) == PTX
        assert s.forget("two") and not s.forget("two")
        gen = s.generation
    with Store(sdir) as s:
        assert s.programs() == {"one": a} and s.generation == gen and s.skipped == {} and s.skipped_files == {}
        assert s.ptx(s.programs()["one"]) == PTX


def test_an_unchanged_record_is_not_written_again(sdir):
    """A restore reloads every recorded program, and records it as it loads: the same record again
    costs no write (the generation stays) and keeps its time; a changed one is written."""
    with Store(sdir) as s:
        a = rec("one", slot=3)
        s.record(a, PTX)
        gen = s.generation
        s.record(dataclasses.replace(a, recorded_at=a.recorded_at + 60), PTX)
        assert s.generation == gen and s.programs()["one"].recorded_at == a.recorded_at
        s.record(dataclasses.replace(a, slot=4), PTX)
        assert s.generation == gen + 1 and s.programs()["one"].slot == 4


def test_of_a_loaded_program(sdir):
    r = ProgramRecord.of("one", {"name": "one"}, PTX, slot=2, nodes=3, device=1, hash=0xABC)
    assert (r.ptx_key, r.hash, r.restart, r.slot, r.nodes, r.device) == (ptx_key(PTX), "0000000000000abc", "on-failure", 2, 3, 1)
    with Store(sdir) as s:
        s.record(r, PTX)
        assert s.programs() == {"one": r}


def test_record_refuses_what_it_could_not_load_back(sdir):
    with Store(sdir) as s:
        with pytest.raises(ValueError, match="ptx_key"):
            s.record(rec("one"), PTX2)
        with pytest.raises(ValueError, match="restart"):
            s.record(rec("one", restart="sometimes"), PTX)
        with pytest.raises(ValueError, match="hash"):
            s.record(rec("one", hash="xyz"), PTX)
        with pytest.raises(ValueError, match="name"):
            s.record(rec("../x"), PTX)
        assert s.programs() == {} and s.generation == 0


def test_ptx_gc(sdir):
    """A PTX that neither the newest nor the previous generation names is removed; one the previous
    still names is kept for a fallback to it."""
    ptx = os.path.join(sdir, "ptx")
    with Store(sdir) as s:
        s.record(rec("one"), PTX)
        s.record(rec("one", PTX2), PTX2)  # an upgrade: PTX is named by the previous generation only
        assert sorted(os.listdir(ptx)) == sorted([f"{ptx_key(PTX)}.ptx", f"{ptx_key(PTX2)}.ptx"])
        s.record(rec("one", PTX2, slot=1), PTX2)  # now neither generation names PTX
        assert os.listdir(ptx) == [f"{ptx_key(PTX2)}.ptx"]
        with open(os.path.join(ptx, "f" * 64 + ".ptx"), "wb") as f:
            f.write(b"nobody's")
        assert s.gc() == ["f" * 64 + ".ptx"]
        s.forget("one")
        s.forget("one")
    with Store(sdir) as s:
        s.record(rec("x", PTX), PTX)
        s.forget("x")
        s.gc()
        assert os.listdir(ptx) == [f"{ptx_key(PTX)}.ptx"]  # the previous generation named it
        s.record(rec("y", PTX2), PTX2)
        assert os.listdir(ptx) == [f"{ptx_key(PTX2)}.ptx"]


def load(path: str) -> dict:
    with open(path, "rb") as f:
        return json.loads(f.read())


def _newest(sdir: str) -> str:
    files = [os.path.join(sdir, n) for n in S.SLOTS if os.path.exists(os.path.join(sdir, n))]
    return max(files, key=lambda p: load(p)["generation"])


def _two_generations(sdir: str) -> tuple[ProgramRecord, ProgramRecord]:
    """Generation 1 holds ``one``; generation 2 holds ``one`` and ``two``."""
    a, b = rec("one"), rec("two", PTX2, slot=1)
    with Store(sdir) as s:
        s.record(a, PTX)
        s.record(b, PTX2)
        assert s.generation == 2
    return a, b


def test_a_torn_newest_file_falls_back_to_the_previous(sdir):
    a, _b = _two_generations(sdir)
    newest = _newest(sdir)
    with open(newest, "rb") as f:
        data = f.read()
    with open(newest, "wb") as f:
        f.write(data[: len(data) // 2])  # torn mid-JSON
    with capture_logs() as logs, Store(sdir) as s:
        assert s.programs() == {"one": a} and s.generation == 1
        assert "not JSON" in s.skipped_files[os.path.basename(newest)]
        s.record(rec("three", PTX2, slot=2), PTX2)  # over the torn file, never over the good one
        assert s.generation == 2
    assert any("skipped" in e["event"] and e.get("file") == newest for e in logs), logs
    with Store(sdir) as s:
        assert set(s.programs()) == {"one", "three"} and s.skipped_files == {}


def test_a_bad_checksum_falls_back_to_the_previous(sdir):
    a, _b = _two_generations(sdir)
    newest = _newest(sdir)
    obj = load(newest)
    obj["programs"]["two"]["slot"] = 9  # a changed byte that is still JSON
    with open(newest, "w") as f:
        json.dump(obj, f)
    with Store(sdir) as s:
        assert s.programs() == {"one": a}
        assert "checksum" in s.skipped_files[os.path.basename(newest)]


def test_an_old_or_missing_schema_is_skipped_a_newer_one_refused(sdir):
    a, _b = _two_generations(sdir)
    newest = _newest(sdir)
    obj = load(newest)
    for schema in (0, None, "1"):
        obj["schema"] = schema
        obj["checksum"] = S._checksum(obj)
        with open(newest, "w") as f:
            json.dump(obj, f)
        with Store(sdir) as s:
            assert s.programs() == {"one": a}, schema
    obj["schema"] = S.SCHEMA + 1
    with open(newest, "w") as f:
        json.dump(obj, f)
    with pytest.raises(StateFileNewer) as ei:
        Store(sdir)
    assert ei.value.file == newest and ei.value.schema == S.SCHEMA + 1 and ei.value.supported == S.SCHEMA
    with open(newest, "w") as f:  # once that file is gone, the store opens (the refusal released its lock)
        f.write("")
    Store(sdir).close()


def test_a_crash_between_write_and_rename_leaves_the_previous_state(sdir, monkeypatch):
    a, b = _two_generations(sdir)
    # as a crash leaves it: a whole temp file of a newer generation, never renamed
    stray = os.path.join(sdir, f".{S.SLOTS[0]}.x1y2{S.TMP_SUFFIX}")
    with open(stray, "w") as f:
        f.write('{"schema": 1, "generation": 3, "programs": {}}')
    with Store(sdir) as s:
        assert s.programs() == {"one": a, "two": b} and s.generation == 2
        assert not os.path.exists(stray)

        def crash(src: str, dst: str) -> None:
            raise OSError(5, "Input/output error")

        monkeypatch.setattr(os, "replace", crash)
        with pytest.raises(StateIOError) as ei:
            s.forget("two")
        assert ei.value.why == "Input/output error" and isinstance(ei.value.__cause__, OSError)
        assert s.programs() == {"one": a, "two": b}  # what failed to write is not what the store holds
        monkeypatch.undo()
    assert [n for n in os.listdir(sdir) if n.endswith(S.TMP_SUFFIX)] == []
    with Store(sdir) as s:
        assert s.programs() == {"one": a, "two": b}


def test_a_record_with_missing_or_corrupt_ptx_is_skipped(sdir):
    _a, b = _two_generations(sdir)
    os.unlink(os.path.join(sdir, "ptx", f"{ptx_key(PTX)}.ptx"))
    with capture_logs() as logs, Store(sdir) as s:
        assert s.programs() == {"two": b}
        assert "missing" in s.skipped["one"]
        with open(os.path.join(sdir, "ptx", f"{ptx_key(PTX2)}.ptx"), "ab") as f:
            f.write(b"changed")
        with pytest.raises(StateIOError, match="corrupt"):
            s.ptx(b)
    assert any(e.get("program") == "one" and "missing" in e.get("why", "") for e in logs), logs
    with Store(sdir) as s:
        assert s.programs() == {} and "corrupt" in s.skipped["two"]


def test_a_malformed_record_is_skipped(sdir):
    _a, b = _two_generations(sdir)
    newest = _newest(sdir)
    obj = load(newest)
    obj["programs"]["one"]["restart"] = "sometimes"
    obj["checksum"] = S._checksum(obj)
    with open(newest, "w") as f:
        json.dump(obj, f)
    with Store(sdir) as s:
        assert s.programs() == {"two": b} and "restart" in s.skipped["one"]


def test_a_skipped_record_is_kept_by_later_writes_and_comes_back_once_repaired(sdir):
    a, b = _two_generations(sdir)
    path = os.path.join(sdir, "ptx", f"{ptx_key(PTX)}.ptx")
    with open(path, "ab") as f:
        f.write(b"damaged")
    ptx3 = b"// program three\n.version 8.0\n"
    c = rec("three", ptx3, slot=2)
    with Store(sdir) as s:
        assert "corrupt" in s.skipped["one"]
        s.record(c, ptx3)  # a later write: "one" stays in the file as it was, its PTX file too
        assert s.programs() == {"two": b, "three": c}
    with Store(sdir) as s:
        assert "corrupt" in s.skipped["one"] and s.programs() == {"two": b, "three": c}
    with open(path, "wb") as f:  # repaired
        f.write(PTX)
    with Store(sdir) as s:
        assert s.programs() == {"one": a, "two": b, "three": c} and not s.skipped
    with open(path, "ab") as f:
        f.write(b"damaged")
    with Store(sdir) as s:
        assert s.forget("one") and "one" not in s.skipped
    with Store(sdir) as s:
        assert s.programs() == {"two": b, "three": c} and not s.skipped
