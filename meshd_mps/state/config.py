"""``meshd-mps serve --config FILE``: serve's options and the programs always loaded, in TOML.

::

    [serve]                      # serve's long flags, "_" for "-"
    isolation = "mps"
    devices = "0,1"              # or [0, 1]
    state_dir = "state"          # paths are relative to this file's directory
    live_restore = true
    daemon_cpus = "3"            # or [3]: the daemon's CPUs, its workers on the others

    [program.echo]               # as supervisord's [program:echo]
    dir = "programs/echo"        # manifest.json and one .ptx or .cu; or manifest = ... with ptx = ... (or cuda = ...)
    nodes = 1
    device = 0
    restart = "on-failure"       # on-failure | always | never

Every value is checked here, so that a mistake is named with its file, line and key
(``ConfigFileError``) before anything starts.  Flags given on the command line override the file,
and the defaults apply last, from the one table ``SERVE_DEFAULTS`` (:func:`merge_serve`).
This module imports only the standard library and meshd-mps's bottom layer (the manifest check
is imported when a program is declared).
"""

from __future__ import annotations

import os
import re
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from meshd_mps.base import defaults
from meshd_mps.base.errors import BadName, ConfigError, ConfigFileError, ManifestError
from meshd_mps.base.names import check_name
from meshd_mps.base.restart import DEFAULT as DEFAULT_RESTART
from meshd_mps.state.store import RESTART

#: serve's options and their defaults, applied after the file and the flags: the one place they are.
SERVE_DEFAULTS: dict[str, Any] = {
    "isolation": defaults.ISOLATION,
    "sms": defaults.SMS,
    "mps_dir": None,  # a temporary directory, removed at exit
    "pool": None,  # POOL_BY_ISOLATION: 4 in MPS mode, 0 in blink mode
    "devices": "all",
    "gpu": defaults.GPU,
    "socket": None,  # client.default_socket(gpu): meshd-mps-sim.sock for --gpu sim (defaults.named)
    "cache_dir": None,
    "log_level": None,  # $MESHD_MPS_LOG_LEVEL, else info
    "log_format": None,  # JSON lines unless stderr is a terminal
    "loop": "auto",
    "stall_after": None,  # Programs' own default, Deadlines.stall
    "state_dir": None,  # statedir.resolve_state_dir(gpu=...): a meshd-mps-sim directory for --gpu sim
    "live_restore": False,
    "orphan_timeout": None,  # Deadlines.orphan
    "daemon_cpus": None,  # unplaced: the scheduler decides (supervision/cpus.py)
    "metrics_address": None,  # off: /metrics on the control socket only (serving/exporter.py)
}

#: ``pool`` when it is None: the idle workers kept ready on each GPU, by isolation (meshd_mps/base/defaults.py).
POOL_BY_ISOLATION = defaults.POOL_BY_ISOLATION


def pool_of(isolation: str, pool: int | None) -> int:
    """The pool size serve runs with: ``pool`` as given, else its isolation's default."""
    return POOL_BY_ISOLATION[isolation] if pool is None else pool


def help_defaults() -> dict[str, str]:
    """Each serve option's default as ``meshd-mps serve --help`` prints it: SERVE_DEFAULTS's value,
    and for a None that stands for a number, that number (read where it is set)."""
    from meshd_mps.base.deadlines import DEFAULT as D

    out = {k: str(v) for k, v in SERVE_DEFAULTS.items() if v is not None and not isinstance(v, bool)}
    out["live_restore"] = "on" if SERVE_DEFAULTS["live_restore"] else "off"
    out["pool"] = ", ".join(f"{n} in {mode} mode" for mode, n in sorted(POOL_BY_ISOLATION.items(), reverse=True))
    out["stall_after"] = f"{D.stall:g}"
    out["orphan_timeout"] = f"{D.orphan:g}"
    return out


#: The longest ``stall_after`` and ``orphan_timeout`` taken (s): 30 days.  A socket timeout far
#: past that overflows the OS's (a worker given 1e10 s died of it).
MAX_SECONDS = 30 * 86400.0


def check_seconds(v: float, what: str = "") -> float:
    """``v`` as ``--stall-after`` and ``--orphan-timeout`` take it; ConfigError otherwise, its
    message after ``what`` (the flag)."""
    if not 0 < v <= MAX_SECONDS:  # NaN and inf too
        raise ConfigError(f"{what + ' ' if what else ''}{v:g}: seconds, more than 0 and at most {MAX_SECONDS:.0f}"
                          " (30 days)")
    return v

#: ``metrics_address``'s host where only a port is given: this machine alone, as exporters default.
METRICS_HOST = "127.0.0.1"


def metrics_address(text: str, what: str = "") -> tuple[str, int]:
    """``metrics_address`` as ``--metrics-address`` takes it: ``HOST:PORT``, ``[IPV6]:PORT``, or
    ``PORT`` (or ``:PORT``) for METRICS_HOST's (port 0: one the kernel picks, which status shows);
    (host, port), else ConfigError after ``what``."""
    head = f"{what} {text!r}: " if what else f"{text!r}: "
    host, sep, port = text.rpartition(":")
    if not sep:
        host, port = "", text
    host = host.strip()
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    elif ":" in host:
        raise ConfigError(head + "an IPv6 address goes in brackets: [::1]:9400")
    if not port.isascii() or not port.isdigit() or not 0 <= int(port) < 65536:
        raise ConfigError(head + "HOST:PORT or PORT expected, the port a number from 0 to 65535")
    if any(c.isspace() or not c.isprintable() for c in host):
        raise ConfigError(head + "the host is a name or an address, without blanks")
    return host or METRICS_HOST, int(port)


CHOICES: dict[str, tuple[str, ...]] = {
    "isolation": ("blink", "mps"),
    "gpu": ("cuda", "sim"),
    "log_level": ("debug", "info", "warning", "error"),
    "log_format": ("json", "console"),
    "loop": ("auto", "uvloop", "asyncio"),
}
PATHS = ("mps_dir", "socket", "cache_dir", "state_dir")
PROGRAM_KEYS = ("dir", "manifest", "ptx", "cuda", "nodes", "device", "restart", "hash")
_HASH = re.compile(r"[0-9a-fA-F]{16}")


@dataclass(frozen=True)
class DeclaredProgram:
    """A ``[program.NAME]`` table, checked, its paths absolute: the files of
    ``serving.client.program_body(dir, manifest, ptx, cuda, hash, nodes, device, arch=..., restart=...)``,
    which makes the load body from them (compiling ``cuda`` for ``arch``).  ``line``: the table's line."""

    name: str
    manifest: str
    ptx: str | None
    cuda: str | None
    dir: str | None
    nodes: int | None
    device: int | None
    restart: str
    hash: str | None
    line: int | None


@dataclass(frozen=True)
class ConfigFile:
    """A config file, checked: ``serve`` holds only the options the file gives (paths absolute)."""

    path: str
    serve: dict[str, Any]
    programs: dict[str, DeclaredProgram]


def merge_serve(flags: Mapping[str, Any], file: ConfigFile | None = None) -> dict[str, Any]:
    """serve's options: each flag given (not None), else the file's value, else ``SERVE_DEFAULTS``.
    ``flags``: argparse's namespace as a dict (``vars(args)``); keys that are not serve's are ignored."""
    out = dict(SERVE_DEFAULTS)
    if file is not None:
        out.update(file.serve)
    out.update({k: v for k, v in flags.items() if k in SERVE_DEFAULTS and v is not None})
    return out


# ---- reading the file -------------------------------------------------------------------------


def load_config(path: str) -> ConfigFile:
    """The config file at ``path``, every value checked: ConfigFileError names the file, the line
    and the key of the first fault."""
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as e:
        raise ConfigFileError(f"{path}: cannot read it: {e.strerror or e}", file=path, line=None, key="") from e
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw[: e.start].count(b"\n") + 1
        raise ConfigFileError(f"{path}:{line}: not UTF-8 text", file=path, line=line, key="") from e
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        at = _decode_line(e)
        where = f"{path}:{at}" if at is not None else path
        raise ConfigFileError(f"{where}: not TOML: {e}", file=path, line=at, key="") from e
    return _Reader(path, text).read(doc)


_AT_LINE = re.compile(r"\(at line (\d+), column \d+\)")


def _decode_line(e: tomllib.TOMLDecodeError) -> int | None:
    """The line of a TOML syntax error: ``e.lineno`` from Python 3.14; before it the number is only
    in the message, read here for display alone (nothing is decided by it)."""
    lineno = getattr(e, "lineno", None)
    if isinstance(lineno, int):
        return lineno
    m = _AT_LINE.search(str(e))
    return int(m.group(1)) if m else None


class _Reader:
    def __init__(self, path: str, text: str):
        self.path = path
        self.base = os.path.dirname(os.path.abspath(path))
        self.text = text

    def fail(self, keys: tuple[str, ...], why: str) -> ConfigFileError:
        line = key_line(self.text, keys)
        key = ".".join(keys)
        where = f"{self.path}:{line}" if line is not None else self.path
        return ConfigFileError(f"{where}: {key}: {why}" if key else f"{where}: {why}", file=self.path, line=line, key=key)

    def read(self, doc: dict[str, Any]) -> ConfigFile:
        for k in doc:
            if k not in ("serve", "program"):
                raise self.fail((k,), "unknown table or key (the file has [serve] and [program.NAME] tables)")
        serve = doc.get("serve", {})
        if not isinstance(serve, dict):
            raise self.fail(("serve",), f"a table expected, got {_tname(serve)}")
        programs = doc.get("program", {})
        if not isinstance(programs, dict):
            raise self.fail(("program",), f"tables [program.NAME] expected, got {_tname(programs)}")
        return ConfigFile(path=self.path, serve={k: self.serve_value(k, v) for k, v in serve.items()},
                          programs={n: self.program(n, t) for n, t in programs.items()})

    # ---- [serve] --------------------------------------------------------------------------
    def serve_value(self, k: str, v: Any) -> Any:
        keys = ("serve", k)
        if k not in SERVE_DEFAULTS:
            raise self.fail(keys, f"unknown option (serve's options: {', '.join(SERVE_DEFAULTS)})")
        if k in CHOICES:
            return self.choice(keys, v, CHOICES[k])
        if k in PATHS:
            return self.path_of(keys, v)
        if k in ("sms", "pool"):
            return self.integer(keys, v, 0)
        if k == "live_restore":
            if not isinstance(v, bool):
                raise self.fail(keys, f"true or false expected, got {_tname(v)}")
            return v
        if k in ("stall_after", "orphan_timeout"):
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                raise self.fail(keys, f"seconds (a number) expected, got {_tname(v)}")
            try:
                return check_seconds(float(v))
            except ConfigError as e:
                raise self.fail(keys, str(e)) from e
        if k == "daemon_cpus":
            return self.cpus(keys, v)
        if k == "metrics_address":
            if not isinstance(v, str):
                raise self.fail(keys, f"\"HOST:PORT\" or \"PORT\" expected, got {_tname(v)}")
            try:
                metrics_address(v)
            except ConfigError as e:
                raise self.fail(keys, str(e)) from e
            return v
        assert k == "devices"
        return self.devices(keys, v)

    def cpus(self, keys: tuple[str, ...], v: Any) -> str:
        """As ``--daemon-cpus`` takes it: "3", "0-3,8" or a list of CPU numbers; kept as the flag's text."""
        from meshd_mps.supervision import cpus

        if not isinstance(v, (str, list)):
            raise self.fail(keys, f"CPUs (\"3\", \"0-3,8\" or a list of numbers) expected, got {_tname(v)}")
        try:
            return cpus.text(cpus.parse(v))
        except ConfigError as e:
            raise self.fail(keys, str(e)) from e

    def devices(self, keys: tuple[str, ...], v: Any) -> str:
        """As ``--devices`` takes it: "all", "0,1" or a list of ordinals; kept as the flag's text."""
        from meshd_mps.gpu.device import check_unique, ordinals_text, parse_devices

        try:
            if isinstance(v, list):
                return ordinals_text(check_unique(v))
            if not isinstance(v, str):
                raise self.fail(keys, f"\"all\", \"0,1\" or a list of GPU ordinals expected, got {_tname(v)}")
            parse_devices(v)
            return v
        except ConfigError as e:
            if isinstance(e, ConfigFileError):
                raise
            raise self.fail(keys, str(e)) from e

    # ---- [program.NAME] -------------------------------------------------------------------
    def program(self, name: str, t: Any) -> DeclaredProgram:
        keys = ("program", name)
        try:
            check_name(name, "the table's name")
        except BadName as e:
            raise self.fail(keys, str(e)) from e
        if not isinstance(t, dict):
            raise self.fail(keys, f"a table expected, got {_tname(t)}")
        for k in t:
            if k not in PROGRAM_KEYS:
                raise self.fail((*keys, k), f"unknown key (a program's keys: {', '.join(PROGRAM_KEYS)})")
        if "dir" in t:
            for k in ("manifest", "ptx", "cuda"):
                if k in t:
                    raise self.fail((*keys, k), "give dir, or manifest with ptx or cuda, not both")
            d = self.path_of((*keys, "dir"), t["dir"])
            manifest, ptx, cuda = self.dir_files((*keys, "dir"), d)
            src_key = "dir"
        elif "manifest" in t:
            d = None
            manifest = self.file((*keys, "manifest"), t["manifest"])
            if ("ptx" in t) == ("cuda" in t):
                raise self.fail(keys, "give one of ptx or cuda with manifest")
            ptx = self.file((*keys, "ptx"), t["ptx"]) if "ptx" in t else None
            cuda = self.file((*keys, "cuda"), t["cuda"]) if "cuda" in t else None
            src_key = "manifest"
        else:
            raise self.fail(keys, "give dir (a program directory), or manifest with ptx or cuda")
        self.check_manifest((*keys, src_key), manifest, name)
        h = t.get("hash")
        if h is not None and (not isinstance(h, str) or not _HASH.fullmatch(h)):
            raise self.fail((*keys, "hash"), f"16 hex digits expected, got {h!r}")
        return DeclaredProgram(
            name=name, manifest=manifest, ptx=ptx, cuda=cuda, dir=d,
            nodes=self.integer((*keys, "nodes"), t["nodes"], 1) if "nodes" in t else None,
            device=self.integer((*keys, "device"), t["device"], 0) if "device" in t else None,
            restart=self.choice((*keys, "restart"), t.get("restart", DEFAULT_RESTART.value), RESTART),
            hash=h, line=key_line(self.text, keys),
        )

    def dir_files(self, keys: tuple[str, ...], d: str) -> tuple[str, str | None, str | None]:
        """A program directory's manifest.json and its one .ptx (else its one .cu), as ``meshd-mps
        load DIR`` picks them (``serving.client.program_body``)."""
        if not os.path.isdir(d):
            raise self.fail(keys, f"{d}: no such directory")
        names = sorted(os.listdir(d))
        ptxs = [n for n in names if n.endswith(".ptx")]
        cus = [n for n in names if n.endswith(".cu")]
        manifest = os.path.join(d, "manifest.json")
        if not os.path.isfile(manifest):
            raise self.fail(keys, f"{d}: no manifest.json")
        if len(ptxs) == 1:
            return manifest, os.path.join(d, ptxs[0]), None
        if len(ptxs) > 1:
            raise self.fail(keys, f"{d}: {len(ptxs)} .ptx files; name one with manifest and ptx")
        if len(cus) == 1:
            return manifest, None, os.path.join(d, cus[0])
        if len(cus) > 1:
            raise self.fail(keys, f"{d}: {len(cus)} .cu files; name one with manifest and cuda")
        raise self.fail(keys, f"{d}: no .ptx or .cu file")

    def check_manifest(self, keys: tuple[str, ...], path: str, name: str) -> None:
        from meshd_mps.gpu.compiler import Manifest

        try:
            with open(path, "rb") as f:
                m = Manifest.parse(f.read())
        except OSError as e:
            raise self.fail(keys, f"{path}: {e.strerror or e}") from e
        except ManifestError as e:
            raise self.fail(keys, f"{path}: {e}") from e
        if m.name != name:
            raise self.fail(keys, f"{path} names the program {m.name!r}, the table [program.{name}]: they must agree")

    # ---- values ---------------------------------------------------------------------------
    def choice(self, keys: tuple[str, ...], v: Any, choices: tuple[str, ...]) -> str:
        if not isinstance(v, str):
            raise self.fail(keys, f"a string expected (one of {', '.join(choices)}), got {_tname(v)}")
        if v not in choices:
            raise self.fail(keys, f"{v!r}: one of {', '.join(choices)} expected")
        return v

    def integer(self, keys: tuple[str, ...], v: Any, lo: int) -> int:
        if isinstance(v, bool) or not isinstance(v, int):
            raise self.fail(keys, f"an integer expected, got {_tname(v)}")
        if v < lo:
            raise self.fail(keys, f"{v}: {lo} or more expected")
        return v

    def path_of(self, keys: tuple[str, ...], v: Any) -> str:
        if not isinstance(v, str) or not v:
            raise self.fail(keys, f"a path (a string) expected, got {_tname(v)}")
        return os.path.normpath(os.path.join(self.base, os.path.expanduser(v)))

    def file(self, keys: tuple[str, ...], v: Any) -> str:
        p = self.path_of(keys, v)
        if not os.path.isfile(p):
            # A directory or a device is there, but is no program's file: say so, not "no such file".
            raise self.fail(keys, f"{p}: not a regular file" if os.path.exists(p) else f"{p}: no such file")
        return p


def _tname(v: Any) -> str:
    return {bool: "a boolean", int: "an integer", float: "a number", str: "a string", list: "an array",
            dict: "a table"}.get(type(v), type(v).__name__)


# ---- where a key is written -------------------------------------------------------------------

_PART = r"""(?:[A-Za-z0-9_-]+|"(?:[^"\\]|\\.)*"|'[^']*')"""
_DOTTED = rf"{_PART}(?:\s*\.\s*{_PART})*"
_HEADER = re.compile(rf"^\s*\[\[?\s*({_DOTTED})\s*\]")
_KEYLINE = re.compile(rf"^\s*({_DOTTED})\s*=")
_SPLIT = re.compile(rf"\s*({_PART})\s*(?:\.|$)")


def _split(dotted: str) -> tuple[str, ...]:
    out: list[str] = []
    for m in _SPLIT.finditer(dotted):
        p = m.group(1)
        out.append(p[1:-1] if p[:1] in ('"', "'") else p)
    return tuple(out)


def key_line(text: str, keys: tuple[str, ...]) -> int | None:
    """The line (1-based) where the dotted key ``keys`` is written in the TOML ``text``: its own
    ``key =`` line (under its ``[table]`` header, or as a dotted key), else the line of the nearest
    enclosing table or key (the header of a table a key is missing from).  tomllib keeps no
    positions, hence this scan; None if nothing of it is found."""
    table: tuple[str, ...] = ()
    best: tuple[int, int] | None = None  # (matched length, line)

    def seen(path: tuple[str, ...], no: int) -> bool:
        nonlocal best
        if path == keys:
            return True
        if len(path) < len(keys) and keys[: len(path)] == path and (best is None or len(path) > best[0]):
            best = (len(path), no)
        return False

    for no, line in enumerate(text.splitlines(), 1):
        h = _HEADER.match(line)
        if h:
            table = _split(h.group(1))
            if seen(table, no):
                return no
            continue
        k = _KEYLINE.match(line)
        if k and seen(table + _split(k.group(1)), no):
            return no
    return best[1] if best else None
