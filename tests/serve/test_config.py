"""``serve --config FILE`` (``meshd_mps/state/config.py``): every error names the file, the line
and the key; flags override the file; without a file, serve's options are what they were."""

from __future__ import annotations

import json
import os
import shutil
import textwrap

import pytest

from meshd_mps.base.errors import ConfigError, ConfigFileError, ManifestError
from meshd_mps.serving import cli, server
from meshd_mps.state.config import SERVE_DEFAULTS, key_line, load_config, merge_serve
from meshd_mps.supervision import cpus

from ..rigs.serve import EXAMPLES, cli as run_cli

MANIFEST = {"name": "echo", "backend": "cuda", "warps": 1, "abi": 1}


def write(tmp_path, text: str, name: str = "meshd-mps.toml") -> str:
    p = tmp_path / name
    p.write_text(textwrap.dedent(text))
    return str(p)


def program_dir(tmp_path, name: str = "echo", files: dict[str, str] | None = None) -> str:
    d = tmp_path / "programs" / name
    d.mkdir(parents=True)
    (d / "manifest.json").write_text(json.dumps({**MANIFEST, "name": name}))
    for n, text in (files if files is not None else {f"{name}.ptx": "// ptx\n"}).items():
        (d / n).write_text(text)
    return str(d)


def refused(path: str) -> ConfigFileError:
    with pytest.raises(ConfigFileError) as ei:
        load_config(path)
    e = ei.value
    assert str(e).startswith(f"{path}:{e.line}: {e.key}: ") or (not e.key and str(e).startswith(f"{path}:{e.line}: "))
    return e


# ---- reading ------------------------------------------------------------------------------------


def test_a_full_file(tmp_path):
    program_dir(tmp_path)
    shutil.copytree(EXAMPLES / "heartbeat", tmp_path / "hb")
    path = write(tmp_path, """\
        # serve's options
        [serve]
        isolation = "mps"
        sms = 4
        pool = 3
        devices = [0, 1]
        gpu = "sim"
        socket = "run/meshd.sock"
        mps_dir = "/abs/mps"
        cache_dir = "~/cache"
        log_level = "debug"
        log_format = "json"
        loop = "asyncio"
        stall_after = 2
        state_dir = "state"
        live_restore = true
        daemon_cpus = "1,0"

        [program.echo]
        dir = "programs/echo"
        nodes = 2
        device = 1
        restart = "always"

        [program.heartbeat]
        manifest = "hb/manifest.json"
        cuda = "hb/heartbeat.cu"
        hash = "0123456789abcdef"
        """)
    c = load_config(path)
    base = str(tmp_path)
    assert c.serve == {"isolation": "mps", "sms": 4, "pool": 3, "devices": "0,1", "gpu": "sim",
                       "socket": f"{base}/run/meshd.sock", "mps_dir": "/abs/mps",
                       "cache_dir": os.path.expanduser("~/cache"), "log_level": "debug", "log_format": "json",
                       "loop": "asyncio", "stall_after": 2.0, "state_dir": f"{base}/state", "live_restore": True,
                       "daemon_cpus": "0-1"}
    echo, hb = c.programs["echo"], c.programs["heartbeat"]
    assert (echo.dir, echo.manifest, echo.ptx, echo.cuda) == (f"{base}/programs/echo", f"{base}/programs/echo/manifest.json",
                                                             f"{base}/programs/echo/echo.ptx", None)
    assert (echo.nodes, echo.device, echo.restart, echo.line) == (2, 1, "always", 19)
    assert (hb.manifest, hb.ptx, hb.cuda, hb.restart, hb.hash) == (f"{base}/hb/manifest.json", None, f"{base}/hb/heartbeat.cu",
                                                                  "on-failure", "0123456789abcdef")
    assert (hb.nodes, hb.device) == (None, None)


def test_a_dir_with_only_cuda(tmp_path):
    program_dir(tmp_path, files={"echo.cu": "// cuda\n"})
    c = load_config(write(tmp_path, '[program.echo]\ndir = "programs/echo"\n'))
    assert c.programs["echo"].cuda == str(tmp_path / "programs/echo/echo.cu") and c.programs["echo"].ptx is None


# ---- every error names file, line and key ---------------------------------------------------------


def test_syntax_error(tmp_path):
    e = refused(write(tmp_path, '[serve]\nisolation = "mps"\npool = = 3\n'))
    assert (e.line, e.key) == (3, "") and "not TOML" in str(e) and e.file.endswith("meshd-mps.toml")


def test_unreadable_and_not_utf8(tmp_path):
    with pytest.raises(ConfigFileError) as ei:
        load_config(str(tmp_path / "nope.toml"))
    assert ei.value.line is None and ei.value.file == str(tmp_path / "nope.toml")
    p = tmp_path / "bin.toml"
    p.write_bytes(b'[serve]\n\nisolation = "\xff"\n')
    assert refused(str(p)).line == 3


@pytest.mark.parametrize(("text", "line", "key", "why"), [
    ('[serve]\nisolation = "mps"\npol = 3\n', 3, "serve.pol", "unknown option"),
    ('[server]\npool = 3\n', 1, "server", "unknown table"),
    ('[serve]\npool = "3"\n', 2, "serve.pool", "an integer expected, got a string"),
    ('[serve]\n\n  pool = -1\n', 3, "serve.pool", "0 or more"),
    ('[serve]\nlive_restore = "yes"\n', 2, "serve.live_restore", "true or false"),
    ('[serve]\nisolation = "green"\n', 2, "serve.isolation", "one of blink, mps"),
    ('[serve]\nstall_after = 0\n', 2, "serve.stall_after", "more than 0"),
    ('[serve]\ndevices = "0,x"\n', 2, "serve.devices", "not a GPU ordinal"),
    ('[serve]\ndevices = [0, 0]\n', 2, "serve.devices", "named twice"),
    ('[serve]\nsocket = 3\n', 2, "serve.socket", "a path"),
    ('[serve]\ndaemon_cpus = 3\n', 2, "serve.daemon_cpus", "expected, got an integer"),
    ('[serve]\ndaemon_cpus = "3-1"\n', 2, "serve.daemon_cpus", "the range 3-1 runs backwards"),
    ('[serve]\ndaemon_cpus = [-1]\n', 2, "serve.daemon_cpus", "-1 is not a CPU number"),
    ('serve = 3\n', 1, "serve", "a table expected"),
    ('[serve]\npool = 1\n[program."echo"]\ndir = "programs/echo"\nrestart = "sometimes"\n', 5, "program.echo.restart",
     "one of on-failure, always, never"),
    ('[program.echo]\ndir = "programs/echo"\nnodes = 0\n', 3, "program.echo.nodes", "1 or more"),
    ('[program.echo]\ndir = "programs/echo"\ndevice = true\n', 3, "program.echo.device", "got a boolean"),
    ('[program.echo]\ndir = "programs/echo"\nhash = "xyz"\n', 3, "program.echo.hash", "16 hex digits"),
    ('[program.echo]\ndir = "programs/echo"\nautostart = true\n', 3, "program.echo.autostart", "unknown key"),
    ('[program.echo]\ndir = "programs/missing"\n', 2, "program.echo.dir", "no such directory"),
    ('[program.echo]\nnodes = 1\n', 1, "program.echo", "give dir"),
    ('[program.echo]\ndir = "programs/echo"\nptx = "x.ptx"\n', 3, "program.echo.ptx", "not both"),
    ('[program.echo]\nmanifest = "programs/echo/manifest.json"\n', 1, "program.echo", "one of ptx or cuda"),
    ('[program.echo]\nmanifest = "programs/echo/manifest.json"\nptx = "nope.ptx"\n', 3, "program.echo.ptx", "no such file"),
    ('[program.echo]\nmanifest = "programs/echo/manifest.json"\nptx = "/dev/null"\n', 3, "program.echo.ptx",
     "/dev/null: not a regular file"),
    ('[program.echo]\nmanifest = "programs"\nptx = "x.ptx"\n', 2, "program.echo.manifest", "not a regular file"),
    ('[program.other]\ndir = "programs/echo"\n', 2, "program.other.dir", "names the program 'echo'"),
    ('[program."../x"]\ndir = "programs/echo"\n', 1, "program.../x", "1-64 characters"),
    ('program.echo.dir = "programs/missing"\n', 1, "program.echo.dir", "no such directory"),  # a dotted key
    ('[program]\necho = 3\n', 2, "program.echo", "a table expected"),
])
def test_errors_name_file_line_and_key(tmp_path, text, line, key, why):
    program_dir(tmp_path)
    e = refused(write(tmp_path, text))
    assert (e.line, e.key) == (line, key), str(e)
    assert why in str(e) and e.file == str(tmp_path / "meshd-mps.toml")


def test_a_bad_manifest_is_named(tmp_path):
    d = program_dir(tmp_path)
    with open(os.path.join(d, "manifest.json"), "w") as f:
        json.dump({**MANIFEST, "warps": 99}, f)
    e = refused(write(tmp_path, '\n[program.echo]\n  dir = "programs/echo"\n'))
    assert (e.line, e.key) == (3, "program.echo.dir") and "'warps'" in str(e)
    assert isinstance(e.__cause__, ManifestError)  # the cause, kept


def test_program_dir_with_two_ptx(tmp_path):
    program_dir(tmp_path, files={"a.ptx": "", "b.ptx": ""})
    e = refused(write(tmp_path, '[program.echo]\ndir = "programs/echo"\n'))
    assert e.key == "program.echo.dir" and "2 .ptx files" in str(e)


def test_key_line():
    text = textwrap.dedent("""\
        top = 1
        [serve]  # a comment
        pool = 2
        "isolation" = "mps"
        [ program . "echo" ]
        dir = "x"
        [program.spin]
        sub.key = 1
        """)
    assert key_line(text, ("top",)) == 1
    assert key_line(text, ("serve", "pool")) == 3
    assert key_line(text, ("serve", "isolation")) == 4
    assert key_line(text, ("program", "echo")) == 5
    assert key_line(text, ("program", "echo", "dir")) == 6
    assert key_line(text, ("program", "echo", "nodes")) == 5  # missing: its table's header
    assert key_line(text, ("program", "spin", "sub", "key")) == 8
    assert key_line(text, ("nowhere",)) is None


# ---- precedence and defaults ----------------------------------------------------------------


def config_of(*argv: str) -> server.Config:
    return cli.serve_config(cli.parser().parse_args(["serve", *argv]))


def test_no_config_is_todays_defaults():
    """The options serve had before the config file: the same Config, field for field."""
    assert config_of() == server.Config(isolation="blink", sms=0, mps_dir=None, pool=None, gpu="cuda", socket=None,
                                        cache_dir=None, log_level=None, log_format=None, loop="auto", devices=None,
                                        stall_after=None)
    assert config_of() == server.Config()
    assert merge_serve({}) == SERVE_DEFAULTS
    c = config_of("--isolation", "mps", "--pool", "4", "--devices", "0,1", "--stall-after", "2.5", "--state-dir", "s",
                  "--live-restore")
    assert (c.isolation, c.pool, c.devices, c.stall_after, c.state_dir, c.live_restore) == ("mps", 4, (0, 1), 2.5, "s", True)


def test_flags_override_the_file(tmp_path):
    program_dir(tmp_path)
    path = write(tmp_path, """\
        [serve]
        isolation = "mps"
        pool = 3
        loop = "asyncio"
        live_restore = true
        state_dir = "state"
        [program.echo]
        dir = "programs/echo"
        """)
    c = config_of("--config", path, "--pool", "1", "--no-live-restore", "--gpu", "sim")
    assert (c.isolation, c.pool, c.loop, c.gpu, c.live_restore) == ("mps", 1, "asyncio", "sim", False)
    assert c.state_dir == str(tmp_path / "state") and c.config_file == path
    assert [p.name for p in c.programs] == ["echo"]
    c = config_of("--config", path, "--state-dir", "other")
    assert (c.pool, c.live_restore, c.state_dir) == (3, True, "other")  # a flag's path is the caller's, as given


def test_serve_reports_a_config_error_and_exits_2(tmp_path):
    path = write(tmp_path, '[serve]\npool = "many"\n')
    r = run_cli("serve", "--config", path, "--gpu", "sim", "--socket", str(tmp_path / "s.sock"))
    assert r.returncode == 2
    assert r.stderr.strip() == f"meshd-mps: {path}:2: serve.pool: an integer expected, got a string"
    r = run_cli("serve", "--gpu", "sim", "--pool", "-1", "--socket", str(tmp_path / "s.sock"))
    assert r.returncode == 2 and r.stderr.strip() == "meshd-mps: --pool must not be negative"
    r = run_cli("serve", "--gpu", "sim", "--socket", "")
    assert r.returncode == 2 and r.stderr.strip() == "meshd-mps: --socket: an empty path", r.stderr


def test_serve_refuses_what_would_fail_later(tmp_path):
    """Through serve_config, as the test above goes (exit 2 with the message): a timeout the OS
    cannot hold (a worker given --orphan-timeout 1e10 died of it), from a flag or the file; a
    negative --sms; an empty path (a variable not set) that would have meant the default."""
    path = write(tmp_path, '[serve]\norphan_timeout = 1e300\n')
    for argv, said in (
            (["--orphan-timeout", "1e10", "--live-restore"], "--orphan-timeout 1e+10: seconds, more than 0 and at most"
                                                             " 2592000 (30 days)"),
            (["--stall-after", "nan"], "--stall-after nan: seconds, more than 0 and at most 2592000 (30 days)"),
            (["--config", path], f"{path}:2: serve.orphan_timeout: 1e+300: seconds, more than 0 and at most 2592000"
                                 " (30 days)"),
            (["--sms", "-1"], "--sms must not be negative"),
            (["--state-dir", ""], "--state-dir: an empty path"),
            (["--mps-dir", ""], "--mps-dir: an empty path")):
        with pytest.raises(ConfigError) as ei:
            config_of("--gpu", "sim", *argv)
        assert str(ei.value) == said
    mine = cpus.text(os.sched_getaffinity(0))
    for flag, said in ((4096, f"--daemon-cpus 4096: this process may use CPUs {mine} only"),
                       ("0-4000000000", "--daemon-cpus '0-4000000000': CPU 4000000000 is past any CPU (Linux numbers"
                                        " them below 8192)"),
                       ("\u00b2", "--daemon-cpus '\u00b2': CPU numbers and ranges separated by commas (3, 2,3 or 0-3,8)"),
                       (mine, f"--daemon-cpus {mine}: that leaves no CPU for the workers (this process may use {mine})"),
                       ("one", "--daemon-cpus 'one': CPU numbers and ranges separated by commas (3, 2,3 or 0-3,8)")):
        r = run_cli("serve", "--gpu", "sim", "--daemon-cpus", str(flag), "--socket", str(tmp_path / "s.sock"))
        assert r.returncode == 2 and r.stderr.strip() == f"meshd-mps: {said}", r.stderr


def test_version():
    r = run_cli("--version")
    assert r.returncode == 0 and r.stdout.startswith("meshd-mps "), r
    assert "(frame protocol 4, program ABI 1, state schema 1)" in r.stdout
