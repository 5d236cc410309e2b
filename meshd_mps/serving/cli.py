"""The ``meshd-mps`` command: ``serve``, ``worker`` and the client subcommands.

``worker`` is dispatched first and imports nothing else (it must start fast);
the client subcommands import only :mod:`meshd_mps.serving.client` and
:mod:`meshd_mps.serving.tables` (standard library); ``serve`` imports the daemon.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import shlex
import sys
from typing import TYPE_CHECKING, Any

from meshd_mps.serving.tables import ps_table, status_table

if TYPE_CHECKING:
    from meshd_mps.serving.server import Config

DESCRIPTION = "Resident CUDA kernels, one MPS client process each: the daemon and its client."
EPILOG = """\
examples:
  meshd-mps serve --isolation mps          # the daemon (--gpu sim: the CPU simulation, no GPU needed)
  meshd-mps load examples/heartbeat        # a program directory: manifest.json + one .cu or .ptx
  meshd-mps check my_prog                  # a program checked without a GPU (the simulation runs only the examples)
  meshd-mps ps                             # the loaded programs
  meshd-mps top                            # live: programs, calls, GPUs, events (pip install 'meshd-mps[top]')
  meshd-mps call echo hello                # a request through a program's ring
  meshd-mps upgrade echo examples/echo     # a new image on the same slot
  meshd-mps unload echo
  meshd-mps serve --config /etc/meshd-mps.toml   # options and always-loaded programs from a TOML file
  meshd-mps fleet --help                   # many nodes run as one, on Ray (docs/fleet.md; pip install 'meshd-mps[fleet]')
the socket: --socket, else $MESHD_MPS_SOCKET, else (client commands) --config FILE's socket, else
  $XDG_RUNTIME_DIR/meshd-mps.sock, else /run/meshd-mps/meshd-mps.sock (root) or /tmp/meshd-mps-$UID/meshd-mps.sock
  (a directory only you can write); a --gpu sim daemon's default is meshd-mps-sim.sock there, and its state dir
  meshd-mps-sim: the client commands reach it with --gpu sim
CUDA C is compiled by this command, as you, for the daemon's oldest GPU, and sent as PTX: the daemon takes PTX only
"""

COMMANDS: dict[str, tuple[str, str]] = {
    "serve": ("run the daemon: programs, workers and the control API on a Unix socket",
              "meshd-mps serve --isolation mps --pool 4\n  meshd-mps serve --isolation mps --devices 0,1"
              "\n  meshd-mps serve --gpu sim   # no GPU: the explicit CPU simulation"),
    "unit": ("print the systemd unit file (Type=notify, KillMode=process), this installation's executable in it",
             "meshd-mps unit > /etc/systemd/system/meshd-mps.service"),
    "worker": ("one MPS client process (started by the daemon, not by hand)", "(started by meshd-mps serve)"),
    "bench": ("measure stalls, round trips, pool and load costs on this GPU (meshd-mps bench --help)",
              "meshd-mps bench\n  meshd-mps bench --gpu sim --quick"),
    "load": ("load a program: compile (CUDA C here, PTX in the daemon), start it on a free mailbox slot",
             "meshd-mps load examples/heartbeat\n  meshd-mps load examples/echo --device 1"
             "\n  meshd-mps load --manifest m.json --ptx prog.ptx --hash 0123456789abcdef"),
    "check": ("check a program without a GPU: compile it for the daemon's GPU (else --arch), mesh_main, its ABI,"
              " registers, resident blocks", "meshd-mps check examples/echo\n  meshd-mps check my_prog --arch sm_90 --nodes 64"),
    "upgrade": ("replace a loaded program's image; it keeps its slot",
                "meshd-mps upgrade echo examples/echo\n  meshd-mps upgrade echo --manifest m.json --cuda echo.cu"),
    "unload": ("halt a program and unload it", "meshd-mps unload echo"),
    "ps": ("list the loaded programs: slot, state, worker, GPU, heartbeat and its age, uptime",
           "meshd-mps ps\n  meshd-mps ps --json"),
    "status": ("the daemon's state: GPUs, isolation, pools, MPS server and clients, versions",
               "meshd-mps status\n  meshd-mps status --json"),
    "top": ("a live view, refreshed every second: each program's state, heartbeat, calls per second and p50/p99,"
            " each GPU's use, the latest events (keys: s sort, r reverse, / filter, q quit)",
            "meshd-mps top\n  meshd-mps top --sort calls/s --filter echo"),
    "native": ("join a CUDA process of yours to our MPS server: print its environment, register its pid",
               'eval "$(meshd-mps native)"; python train.py &  meshd-mps native --add $!'),
    "write": ("write FILE (- for stdin) into a running program's data at OFFSET, while it runs",
              "meshd-mps write table 4096 rows.bin"),
    "call": ("send DATA (or a file's bytes) to a program's request ring and print its response (or write it)",
             "meshd-mps call echo hello\n  meshd-mps call echo --hex 00ff10 --timeout 2\n"
             "  meshd-mps call echo --in query.bin --out answer.bin"),
}


def _sub(sub: Any, name: str, formatter: type[argparse.HelpFormatter] = argparse.RawDescriptionHelpFormatter,
         ) -> argparse.ArgumentParser:
    line, example = COMMANDS[name]
    return sub.add_parser(name, help=line, description=line[0].upper() + line[1:] + ".",
                          epilog=f"example:\n  {example}", formatter_class=formatter)


class _ServeHelp(argparse.RawDescriptionHelpFormatter):
    """serve's --help: ``%(default)s`` is the option's default as state/config.py sets it
    (``help_defaults``), read only when the help is printed (the parser's own defaults are None, and
    the client commands start without importing the config module)."""

    def _expand_help(self, action: argparse.Action) -> str:
        from meshd_mps.state.config import help_defaults

        shown = help_defaults().get(action.dest)
        if shown is not None:
            action = copy.copy(action)
            action.default = shown
        return super()._expand_help(action)


def _client_opts(p: argparse.ArgumentParser, json: bool = True) -> None:
    p.add_argument("--socket", metavar="PATH", help="the daemon's socket (default: $MESHD_MPS_SOCKET, else --config's"
                   " socket, else $XDG_RUNTIME_DIR/meshd-mps.sock, /run/meshd-mps/meshd-mps.sock for root, else"
                   " /tmp/meshd-mps-$UID/meshd-mps.sock); refused if another user owns it")
    p.add_argument("--config", metavar="FILE", help="the file serve reads (serve --config): its socket is used")
    p.add_argument("--gpu", choices=("cuda", "sim"), help="whose default socket: the daemon on the GPU (cuda, the"
                   " default) or a serve --gpu sim (meshd-mps-sim.sock beside it)")
    if json:
        p.add_argument("--json", action="store_true", help="print the daemon's JSON answer")


def _image_opts(p: argparse.ArgumentParser, nodes: bool) -> None:
    p.add_argument("dir", nargs="?", metavar="DIR", help="a program directory: manifest.json and one .ptx or .cu file")
    p.add_argument("--manifest", metavar="FILE", help="the manifest (instead of DIR/manifest.json)")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--ptx", metavar="FILE", help="the program's PTX")
    src.add_argument("--cuda", metavar="FILE", help="the program's CUDA C source: compiled here, as you, with NVRTC for"
                     " the daemon's oldest GPU, and sent as PTX (the daemon takes PTX only)")
    p.add_argument("--hash", metavar="H", help="the image hash expected (16 hex digits); another image is refused")
    p.add_argument("--data", metavar="FILE", help="the program's data: device memory it owns, FILE copied in (default: the"
                   " manifest's data file; an upgrade keeps the program's data unless given)")
    p.add_argument("--restart", choices=("on-failure", "always", "never"),
                   help="when it comes back by itself: on-failure (when it fails or faults; the default), always (also"
                        " when it returns), never; with backoff, and not after 5 failures within 60 s (crash-loop)"
                        + ("" if nodes else "; an upgrade keeps the program's own unless given"))
    if nodes:
        p.add_argument("--restore", choices=("reload", "adopt"),
                       help="what the daemon's next start does with it: reload it from its record if it no longer"
                            " runs (the default), or adopt it only while it runs and otherwise leave it to whoever"
                            " loaded it (the fleet's replicas)")
        p.add_argument("--nodes", type=int, metavar="N", help="blocks to launch (default 1)")
        p.add_argument("--device", type=int, metavar="N",
                       help="the GPU to run it on, a CUDA ordinal (default: the one with the fewest programs)")


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="meshd-mps", description=DESCRIPTION, epilog=EPILOG,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--version", action=_Version, nargs=0, help="print meshd-mps's version and the ABI it speaks")
    sub = ap.add_subparsers(dest="cmd", required=True, metavar="COMMAND")

    s = _sub(sub, "serve", _ServeHelp)
    # Every default here is None, so that a flag not given is seen as such: the config file's value,
    # else state/config.py's SERVE_DEFAULTS, applies then (serve_config).
    s.add_argument("--config", metavar="FILE", help="serve's options ([serve]) and the programs always loaded"
                   " ([program.NAME]) from a TOML file; flags given here override it")
    s.add_argument("--isolation", choices=("blink", "mps"),
                   help="blink: one CUDA context, a load halts every program briefly; mps: one MPS client per program"
                        " (default %(default)s)")
    s.add_argument("--sms", type=int, metavar="N",
                   help="SMs per program, a green context (0: the whole device; default %(default)s)")
    s.add_argument("--mps-dir", metavar="DIR",
                   help="the private MPS daemon's directory (default: a temporary one, removed at exit)")
    s.add_argument("--pool", type=int, metavar="N", help="idle workers kept ready on each GPU (default %(default)s)")
    s.add_argument("--devices", metavar="LIST",
                   help="the GPUs to drive: CUDA ordinals such as 0,1, or all (every visible one; default %(default)s)")
    s.add_argument("--gpu", choices=("cuda", "sim"),
                   help="cuda: the GPU; sim: the explicit CPU simulation, for trying meshd-mps without one (default %(default)s)")
    s.add_argument("--socket", metavar="PATH", help="the control socket (default: $MESHD_MPS_SOCKET, "
                   "$XDG_RUNTIME_DIR/meshd-mps.sock, /run/meshd-mps/meshd-mps.sock for root, else"
                   " /tmp/meshd-mps-$UID/meshd-mps.sock; meshd-mps-sim.sock with --gpu sim); its directory must be writable by"
                   " this user only")
    s.add_argument("--cache-dir", metavar="DIR", help="keep compiled cubins here across restarts")
    s.add_argument("--log-level", choices=("debug", "info", "warning", "error"), help="default info ($MESHD_MPS_LOG_LEVEL)")
    s.add_argument("--log-format", choices=("json", "console"), help="default: JSON lines unless stderr is a terminal")
    s.add_argument("--loop", choices=("auto", "uvloop", "asyncio"),
                   help="the event loop: auto takes uvloop where it is installed (default %(default)s)")
    s.add_argument("--stall-after", type=float, metavar="S",
                   help="a running program whose heartbeat has not advanced for S seconds is shown as stalled"
                        " (default %(default)s)")
    s.add_argument("--state-dir", metavar="DIR", help="the desired state kept across restarts (default: $STATE_DIRECTORY,"
                   " else /var/lib/meshd-mps for root, else $XDG_STATE_HOME/meshd-mps or ~/.local/state/meshd-mps;"
                   " meshd-mps-sim instead of meshd-mps with --gpu sim);"
                   " it must be this user's, mode 0700; every load, upgrade and unload is recorded there, and the"
                   " next start loads the recorded programs again on their slots")
    s.add_argument("--live-restore", action=argparse.BooleanOptionalAction,
                   help="leave the programs running when the daemon stops (SIGTERM, SIGINT, SIGHUP) or dies, for the"
                        " next one with the same --state-dir to adopt: the workers, their kernels, the MPS daemon and"
                        " the mailbox stay (default %(default)s: a stop halts every program)")
    s.add_argument("--daemon-cpus", metavar="LIST",
                   help="host CPUs for the daemon alone (3, 2,3 or 0-3,8): its workers and the MPS daemon run on the"
                        " others, so that none takes the event loop's CPU (default: the scheduler places every thread)")
    s.add_argument("--metrics-address", metavar="HOST:PORT",
                   help="also serve GET /metrics over TCP there, for a Prometheus to scrape (PORT alone: 127.0.0.1's;"
                        " [::1]:PORT for IPv6; default: off, /metrics on the control socket only)")
    s.add_argument("--orphan-timeout", type=float, metavar="S",
                   help="with --live-restore: how long the programs run on with no daemon before their workers halt"
                        " them and exit (default %(default)s)")

    p = _sub(sub, "unit")
    p.add_argument("--exec", metavar="PATH", dest="executable",
                   help="the meshd-mps executable for ExecStart= (default: this one's, found beside its Python or on PATH)")

    _sub(sub, "worker")
    _sub(sub, "bench")

    p = _sub(sub, "load")
    _image_opts(p, nodes=True)
    _client_opts(p)

    p = _sub(sub, "check")
    p.add_argument("dir", nargs="?", metavar="DIR", help="a program directory: manifest.json and one .ptx or .cu file")
    p.add_argument("--manifest", metavar="FILE", help="the manifest (instead of DIR/manifest.json)")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--ptx", metavar="FILE", help="the program's PTX")
    src.add_argument("--cuda", metavar="FILE", help="the program's CUDA C source (compiled here with NVRTC)")
    p.add_argument("--nodes", type=int, metavar="N", help="blocks it is to be launched with (default 1)")
    p.add_argument("--arch", metavar="sm_XY", help="the GPU architecture to check for (default: the daemon's oldest GPU"
                   " where one answers, else sm_90)")
    _client_opts(p)

    p = _sub(sub, "upgrade")
    p.add_argument("name", metavar="NAME", help="the loaded program")
    _image_opts(p, nodes=False)
    _client_opts(p)

    p = _sub(sub, "unload")
    p.add_argument("name", metavar="NAME", help="the loaded program")
    _client_opts(p)

    _client_opts(_sub(sub, "ps"))
    _client_opts(_sub(sub, "status"))

    p = _sub(sub, "top")  # serving/top.py
    p.add_argument("--sort", metavar="COLUMN", help="the column to sort by (default name; key s: the next one)")
    p.add_argument("--reverse", action="store_true", help="sort the other way (key r)")
    p.add_argument("--filter", metavar="TEXT", help="only the programs whose name holds TEXT (key /)")
    p.add_argument("--interval", type=float, default=1.0, metavar="S", help="seconds between looks (default 1)")
    p.add_argument("--once", action="store_true", help="print one frame and exit")
    _client_opts(p, json=False)

    p = _sub(sub, "native")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--add", type=int, metavar="PID", help="register PID (a client of our MPS server) as a native client")
    g.add_argument("--drop", type=int, metavar="PID", help="no longer count PID as a native client")
    _client_opts(p)

    p = _sub(sub, "write")
    p.add_argument("name", metavar="NAME", help="the loaded program")
    p.add_argument("offset", type=int, metavar="OFFSET", help="where in its data, in bytes")
    p.add_argument("file", metavar="FILE", help="the bytes to write (at most 64 MiB; - for stdin)")
    _client_opts(p)

    p = _sub(sub, "call")
    p.add_argument("name", metavar="NAME", help="the loaded program")
    from meshd_mps.serving import callio

    callio.add_options(p)
    p.add_argument("--timeout", type=float, metavar="S", help="seconds to wait for the response (default 5)")
    _client_opts(p)
    return ap


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["worker"]:
        from workers.start import run  # the worker's own start (python -m workers), importing nothing else

        return run(argv[1:])
    if argv[:1] == ["bench"]:
        from meshd_mps.bench import main as bench_main  # it has its own options (--gpu, --quick, --json)

        return bench_main(argv[1:])
    args = parser().parse_args(argv)
    if args.cmd == "serve":
        from meshd_mps.base.errors import ConfigError
        from meshd_mps.serving import server

        try:
            cfg = serve_config(args)
        except ConfigError as e:
            print(f"meshd-mps: {e}", file=sys.stderr)
            return 2
        return server.main(cfg)
    if args.cmd == "unit":
        from meshd_mps.base.errors import ConfigError
        from meshd_mps.serving.unit import unit_text

        try:
            print(unit_text(args.executable), end="")
        except ConfigError as e:
            print(f"meshd-mps: {e}", file=sys.stderr)
            return 2
        return 0
    if args.cmd == "check":
        from meshd_mps.serving import check
        from meshd_mps.serving.client import ClientError

        try:  # the daemon asked for its GPU is the one every client command asks (--gpu sim's too)
            socket = _socket_of(args)
        except ClientError as e:
            print(f"meshd-mps: {e}", file=sys.stderr)
            return 2
        return check.main(args, socket)
    if args.cmd == "top":
        from meshd_mps.serving import top

        return top.main(args, lambda: _socket_of(args))  # its ClientError (a bad --config) said by top
    return _client(args)


# ---- serve's options ------------------------------------------------------------------------


def serve_config(args: argparse.Namespace) -> Config:
    """serve's options: the flags given, over the ``--config`` file's ``[serve]``, over
    ``SERVE_DEFAULTS`` (``state/config.py``), with the file's ``[program.NAME]`` tables; ConfigError
    (ConfigFileError naming the file, line and key) for a value that cannot work."""
    from meshd_mps.base.errors import ConfigError
    from meshd_mps.gpu.device import parse_devices
    from meshd_mps.serving import server
    from meshd_mps.state.config import check_seconds, load_config, merge_serve, metrics_address
    from meshd_mps.supervision import cpus

    file = load_config(args.config) if args.config is not None else None
    o = merge_serve(vars(args), file)
    for k in ("pool", "sms"):
        if o[k] is not None and o[k] < 0:
            raise ConfigError(f"--{k} must not be negative")
    for k in ("stall_after", "orphan_timeout"):
        if o[k] is not None:
            check_seconds(o[k], f"--{k.replace('_', '-')}")
    for k in ("socket", "state_dir", "mps_dir", "cache_dir"):
        if o[k] == "":  # not the default: an empty path is a mistake (a variable not set), not a choice
            raise ConfigError(f"--{k.replace('_', '-')}: an empty path")
    daemon_cpus = None
    if o["daemon_cpus"] is not None:
        daemon_cpus = cpus.parse(o["daemon_cpus"], "--daemon-cpus")
        cpus.split(daemon_cpus, "--daemon-cpus")  # refused here, before anything starts, as the other options are
    return server.Config(isolation=o["isolation"], sms=o["sms"], mps_dir=o["mps_dir"], pool=o["pool"], gpu=o["gpu"],
                         socket=o["socket"], cache_dir=o["cache_dir"], log_level=o["log_level"],
                         log_format=o["log_format"], loop=o["loop"], devices=parse_devices(o["devices"]),
                         stall_after=o["stall_after"], state_dir=o["state_dir"], live_restore=o["live_restore"],
                         orphan_timeout=o["orphan_timeout"],
                         daemon_cpus=daemon_cpus,
                         metrics_address=None if o["metrics_address"] is None
                         else metrics_address(o["metrics_address"], "--metrics-address"),
                         config_file=None if file is None else os.path.abspath(file.path),
                         programs=() if file is None else tuple(file.programs.values()))


# ---- --version ----------------------------------------------------------------


def version_line() -> str:
    """``meshd-mps X.Y.Z (frame protocol P, program ABI N, state schema M)``."""
    from meshd_mps.base.version import version  # here, not at the top: the worker starts through this module
    from meshd_mps.protocol.abi import RT_ABI
    from meshd_mps.protocol.frames import PROTOCOL_VERSION
    from meshd_mps.state.store import SCHEMA

    return f"meshd-mps {version()} (frame protocol {PROTOCOL_VERSION}, program ABI {RT_ABI}, state schema {SCHEMA})"


class _Version(argparse.Action):
    """--version, computed only when asked (the client commands start without the metadata scan)."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        print(version_line())
        parser.exit()


# ---- the client commands ------------------------------------------------------------------


def _client(args: argparse.Namespace) -> int:
    from meshd_mps.serving.client import Client, ClientError, NoDaemon, read_input

    try:
        c = Client(_socket_of(args), gpu=args.gpu)
    except ClientError as e:
        print(f"meshd-mps: {e}", file=sys.stderr)
        return 2
    try:
        if args.cmd in ("load", "upgrade"):
            # CUDA C is compiled here (as this user), for the daemon's oldest GPU; the daemon gets PTX.
            body = c.program_body(args.dir, args.manifest, args.ptx, args.cuda, args.hash, getattr(args, "nodes", None),
                                  getattr(args, "device", None), restart=args.restart, loading=args.cmd == "load")
            if getattr(args, "restore", None) is not None:
                body["restore"] = args.restore
            c.with_data(body, args.data, args.dir, args.manifest)
            ans = c.load(body) if args.cmd == "load" else c.upgrade(args.name, body)
            if args.json:
                return _json(ans)
            p = ans["program"]
            how = "from the cache" if p.get("cached") else f"compiled in {p.get('compile_ms', 0):.1f} ms"
            if args.cmd == "load":
                print(f"{p['name']} loaded on slot {p['slot']} (pid {p['pid']}, hash {p['hash']},"
                      f" GPU {p.get('device', 0)}, {how})")
            else:
                print(f"{p['name']} upgraded on slot {p['slot']} (upgrade {p['upgrades']}, pid {p['pid']},"
                      f" hash {p['hash']}, {how})")
            if made := ans.get("new_client"):  # no pooled worker free for it: a client made now, said
                print(f"  a new MPS client was made for it (no pooled worker was free for it): each running program"
                      f" of GPU {p.get('device', 0)} stalled once, ~{made['stall_us_estimate']:.0f} us at"
                      f" {made['clients']} clients (an estimate)")
        elif args.cmd == "unload":
            ans = c.unload(args.name)
            if args.json:
                return _json(ans)
            p = ans["program"]
            print(f"{p['name']} unloaded from slot {p.get('slot')}")
            if ans.get("warning"):
                print(f"meshd-mps: warning: {ans['warning']}", file=sys.stderr)
        elif args.cmd == "ps":
            ans = c.request("GET", "/v1/programs")
            if args.json:
                return _json(ans)
            print(ps_table(ans["programs"]), end="")
        elif args.cmd == "status":
            ans = c.status()
            if args.json:
                return _json(ans)
            print(status_table(ans), end="")
        elif args.cmd == "native":
            ans = c.native(args.add, args.drop)
            if args.json:
                return _json(ans)
            if args.add is None and args.drop is None:
                for k, v in ans["env"].items():
                    print(f"export {k}={shlex.quote(v)}")
            print(f"# native clients: {' '.join(map(str, ans['clients'])) or 'none'}")
        elif args.cmd == "write":
            ans = c.write(args.name, args.offset, read_input(args.file))
            if args.json:
                return _json(ans)
            print(f"{args.name}: {ans['bytes']} bytes written at {ans['offset']}"
                  + (f" (DATA_SEQ {ans['seq']})" if ans.get("seq") is not None else " (placed at its next launch)"))
        elif args.cmd == "call":
            from meshd_mps.serving import callio

            if (answer := callio.call(c, args)) is not None:  # --json
                return _json(answer)
        else:  # pragma: no cover - argparse knows the commands
            raise ClientError(f"unknown command {args.cmd}")
    except NoDaemon as e:
        print(f"meshd-mps: {e}{_sim_hint(args, c.socket)}", file=sys.stderr)
        return 1
    except ClientError as e:
        print(f"meshd-mps: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    return 0


def _socket_of(args: argparse.Namespace) -> str:
    """--socket, else $MESHD_MPS_SOCKET, else --config's socket, else --gpu's default (client_socket);
    ClientError for a config file that serve would refuse too."""
    from meshd_mps.serving.client import ClientError, client_socket

    file_socket = None
    if args.config is not None:
        from meshd_mps.base.errors import ConfigError
        from meshd_mps.state.config import load_config

        try:
            file_socket = load_config(args.config).serve.get("socket")
        except ConfigError as e:
            raise ClientError(str(e)) from e
    return client_socket(args.socket, file_socket, args.gpu)


def _sim_hint(args: argparse.Namespace, tried: str) -> str:
    """For a default socket nobody serves on: where the other kind of daemon (``--gpu sim`` or the
    GPU's) serves, if its default socket is there, and how to reach it."""
    from meshd_mps.serving.client import SOCKET_ENV, own_socket

    if args.socket or os.environ.get(SOCKET_ENV) or args.config:
        return ""
    other = "cuda" if args.gpu == "sim" else "sim"
    there = own_socket(other)
    if there == tried or not os.path.exists(there):
        return ""
    who = "a meshd-mps serve --gpu sim" if other == "sim" else "the daemon on the GPU"
    return f"; {who} has its socket at {there}: add --gpu {other} (or --socket {there})"


def _json(ans: dict[str, Any]) -> int:
    print(json.dumps(ans, indent=2))
    return 0
