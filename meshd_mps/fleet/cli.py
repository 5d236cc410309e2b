"""``meshd-mps fleet ...``: the fleet's command line, over the Python API (``meshd_mps.fleet``) only.

Reached through ``meshd_mps/cli.py``, which has already imported Ray by importing this package (or
said in one line how to install it).  Every refusal is one line, in the words the node's command
line uses (``meshd-mps: ...``): bad input (a program directory that is not there, ``--replicas 0``,
an unknown ``--strategy``) exits 2 before anything is asked of the cluster; a refusal of the fleet's
(no such program, a call that timed out) exits 1.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
from collections.abc import Awaitable, Callable
from typing import Any, NoReturn

from meshd_mps.base.deadlines import Deadlines
from meshd_mps.base.errors import BadRequest, FleetUnavailable, MeshError
from meshd_mps.fleet import Fleet, ProgramSource, ProgramSpec
from meshd_mps.fleet.checkpoint import NAMESPACE
from meshd_mps.fleet.metrics import exposition
from meshd_mps.fleet.tables import Watch, as_json, events_table, node, node_table, replicas, status_table
from meshd_mps.serving import callio
from meshd_mps.serving.client import ClientError

PROG = "meshd-mps fleet"
DESCRIPTION = "Many meshd-mps nodes run as one, on Ray: programs declared once, placed by Ray, kept by each node's daemon."
EPILOG = """\
examples:
  ray start --address HEAD:6379 --resources "$(meshd-mps fleet resources --node NAME)"   # each node, beside its daemon
  meshd-mps fleet deploy examples/echo --replicas 3 --wait
  meshd-mps fleet status                    # a row per replica: node, GPU, slot, state, heartbeat age, why pending
  meshd-mps fleet status --watch            # then a row each time a replica changes (kubectl get -w)
  meshd-mps fleet status --nodes            # a row per node: slots, replicas, free, why not usable
  meshd-mps fleet events                    # what happened: replicas moved, nodes lost, another fleet's daemon
  meshd-mps fleet metrics                   # the fleet's Prometheus metrics (text format)
  meshd-mps fleet top                       # live: programs, replicas and nodes, their calls, the events
  meshd-mps fleet call echo hello           # by name, from anywhere in the cluster: the caller's node first
  meshd-mps fleet upgrade echo examples/echo   # rolling: at most one replica unavailable
  meshd-mps fleet remove echo
  meshd-mps fleet bench                     # the fleet's costs on a local cluster of simulated GPUs (--help)
the cluster: --address, else $RAY_ADDRESS, else the Ray cluster this host belongs to (docs/fleet.md)
"""

COMMANDS: dict[str, tuple[str, str]] = {
    "deploy": ("declare a program on the fleet: Ray places its replicas, each node's daemon runs them",
               "meshd-mps fleet deploy examples/echo --replicas 3 --strategy SPREAD --wait"),
    "status": ("every program and replica: node, GPU, slot, state, heartbeat age, and why one is pending",
               "meshd-mps fleet status\n  meshd-mps fleet status echo --watch\n  meshd-mps fleet status --json"),
    "events": ("what happened, oldest first: replicas placed, moved, failed; nodes joined, lost, held by another fleet",
               "meshd-mps fleet events\n  meshd-mps fleet events echo --json"),
    "metrics": ("the fleet's metrics in Prometheus' text format: replicas per program and state, slots per node, moves,"
                " each replica's state, heartbeat and calls",
                "meshd-mps fleet metrics > /var/lib/node_exporter/textfile/meshd-mps-fleet.prom"),
    "top": ("a live view, refreshed every second: programs, replicas and nodes across the fleet, their calls, the"
            " latest events (keys: s sort, r reverse, / filter, q quit)", "meshd-mps fleet top --filter echo"),
    "upgrade": ("a new image for a declared program, replica by replica (at most one unavailable)",
                "meshd-mps fleet upgrade echo examples/echo"),
    "remove": ("remove a program from the fleet: every replica halted and unloaded", "meshd-mps fleet remove echo"),
    "call": ("send DATA to one replica of a program (the caller's node first) and print its response",
             "meshd-mps fleet call echo hello\n  meshd-mps fleet call echo --hex 00ff --idempotent --timeout 2"),
    "resources": ("print this node's capacity as Ray resources (JSON for ray start --resources), from its daemon",
                  'ray start --address HEAD:6379 --resources "$(meshd-mps fleet resources)"'),
}

#: How often ``status --watch`` looks again: a poll interval, not a deadline (each look has its own).
WATCH_EVERY = 1.0


class _Parser(argparse.ArgumentParser):
    """argparse whose refusal is one line (``meshd-mps fleet deploy: --replicas: ...``), exit 2, as
    every other refusal of this command is; the usage is in ``--help``."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: {message}\n")


def _sub(sub: Any, name: str) -> argparse.ArgumentParser:
    line, example = COMMANDS[name]
    p: argparse.ArgumentParser = sub.add_parser(name, help=line, description=line[0].upper() + line[1:] + ".",
                                                epilog=f"example:\n  {example}",
                                                formatter_class=argparse.RawDescriptionHelpFormatter)
    if name != "resources":
        p.add_argument("--address", metavar="ADDR", help="the Ray cluster (default: $RAY_ADDRESS, else this host's)")
        p.add_argument("--namespace", metavar="NS", default=NAMESPACE,
                       help="the fleet's Ray namespace, for a second fleet in one cluster (default %(default)s)")
    return p


def _image_opts(p: argparse.ArgumentParser) -> None:
    """The program's files, read as ``meshd-mps load`` reads them (state/program_files.py)."""
    p.add_argument("dir", nargs="?", metavar="DIR", help="a program directory: manifest.json and one .ptx or .cu file")
    p.add_argument("--manifest", metavar="FILE", help="the manifest (instead of DIR/manifest.json)")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--ptx", metavar="FILE", help="the program's PTX")
    src.add_argument("--cuda", metavar="FILE", help="the program's CUDA C source: compiled here, as you, and sent as PTX")
    p.add_argument("--hash", metavar="H", help="the image hash expected (16 hex digits); another image is refused")


def parser() -> argparse.ArgumentParser:
    ap = _Parser(prog=PROG, description=DESCRIPTION, epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True, metavar="COMMAND", parser_class=_Parser)

    p = _sub(sub, "deploy")
    _image_opts(p)
    p.add_argument("--name", metavar="N", help="the program's name in the fleet (default: the manifest's)")
    # Checked by ProgramSpec, the one place for what a spec may hold (the API's words and limits).
    p.add_argument("--replicas", type=int, metavar="K", default=1, help="how many copies run, each on a slot of its own"
                   " (default 1)")
    p.add_argument("--restart", metavar="P", help="on-failure, always or never (default: the node's, on-failure)")
    p.add_argument("--strategy", metavar="S", default="SPREAD",
                   help="how Ray places the replicas: SPREAD (default), PACK or STRICT_SPREAD (one node each)")
    p.add_argument("--gpu", metavar="MODEL", help="only on GPUs of this model (as `meshd-mps fleet resources` names it)")
    p.add_argument("--node", metavar="NAME", help="only on the node of this name (`meshd-mps fleet resources --node NAME`)")
    p.add_argument("--unique", action="store_true",
                   help="no replica ever runs on two nodes at once (fenced by a lease; a node or head away longer than"
                        " the lease halts its replicas); without it a replica may briefly run twice while it moves")
    p.add_argument("--data", metavar="FILE", help="the program's data (default: the manifest's data file): put once into"
                   " Ray's object store, each node's daemon gets it from there")
    p.add_argument("--wait", action="store_true", help="wait until every replica runs")
    p.add_argument("--timeout", type=float, metavar="S", default=Deadlines().fleet_node,
                   help="with --wait: at most S seconds (default %(default)s)")
    p.add_argument("--json", action="store_true", help="print the answer as JSON")

    p = _sub(sub, "status")
    p.add_argument("name", nargs="?", metavar="NAME", help="one program (default: every one)")
    p.add_argument("--json", action="store_true", help="the whole status as JSON: programs, replicas, nodes, events")
    p.add_argument("--watch", "-w", action="store_true", help="after the table, a row each time a replica changes")
    p.add_argument("--nodes", action="store_true", help="a row per node instead: slots, replicas, free, why not usable")

    p = _sub(sub, "events")
    p.add_argument("name", nargs="?", metavar="NAME", help="one program's, and the nodes' (default: every one)")
    p.add_argument("--json", action="store_true", help="the events as JSON")

    _sub(sub, "metrics")

    p = _sub(sub, "top")  # fleet/top.py, on the node's screen (serving/screen.py)
    p.add_argument("--sort", metavar="COLUMN", help="the programs' column to sort by (default program; key s)")
    p.add_argument("--reverse", action="store_true", help="sort the other way (key r)")
    p.add_argument("--filter", metavar="TEXT", help="only the programs whose name holds TEXT (key /)")
    p.add_argument("--interval", type=float, default=1.0, metavar="S", help="seconds between looks (default 1)")
    p.add_argument("--once", action="store_true", help="print one frame and exit")

    p = _sub(sub, "upgrade")
    p.add_argument("name", metavar="NAME", help="the declared program")
    _image_opts(p)
    p.add_argument("--json", action="store_true", help="print the answer as JSON")

    p = _sub(sub, "remove")
    p.add_argument("name", metavar="NAME", help="the declared program")

    p = _sub(sub, "call")
    p.add_argument("name", metavar="NAME", help="the declared program")
    callio.add_options(p)
    p.add_argument("--timeout", type=float, metavar="S", help="seconds to wait for the response")
    p.add_argument("--idempotent", action="store_true",
                   help="the request may run twice: retried on another replica if the one asked is lost")
    p.add_argument("--json", action="store_true", help="the response and the replica that answered, as JSON")

    p = _sub(sub, "resources")
    p.add_argument("--socket", metavar="PATH", help="the node daemon's socket (default: as meshd-mps status finds it)")
    p.add_argument("--node", metavar="NAME", help="also advertise this node's name, for deploy --node NAME")
    p.add_argument("--slots", type=int, metavar="N", help="at most N programs here (default: the daemon's limits)")
    return ap


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    # Ray's warnings about this driver process are not the user's business (connected from a thread,
    # it gets no SIGTERM handler of Ray's): what the user reads is the answer, or one line of error.
    # The module's own logger: ray.init sets the level of "ray" itself.
    logging.getLogger("ray._private.worker").setLevel(logging.ERROR)
    if argv[:1] == ["bench"]:
        from meshd_mps.fleet.bench import main as bench_main  # its own options; a local cluster of its own

        return bench_main(argv[1:])
    args = parser().parse_args(argv)
    try:
        if args.cmd == "resources":
            return resources(args.socket, args.node, args.slots)
        ask = _command(args)  # the files read and the spec checked before the cluster is asked anything
        return asyncio.run(_with_fleet(args.address, args.namespace, ask))
    except BadRequest as e:  # bad input: nothing was changed
        print(f"meshd-mps: {e}", file=sys.stderr)
        return 2
    except FleetUnavailable as e:  # no cluster answers: what to do about it, on the same line
        print(f"meshd-mps: {e} ({e.hint})", file=sys.stderr)
        return 1
    except MeshError as e:
        print(f"meshd-mps: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


Command = Callable[[Fleet], Awaitable[int]]


async def _with_fleet(address: str | None, namespace: str, ask: Command) -> int:
    fleet = await Fleet.connect(address, namespace=namespace)
    try:
        return await ask(fleet)
    finally:
        await fleet.close()


def source(args: argparse.Namespace) -> ProgramSource:
    """The program's files as ``meshd-mps load`` reads them; ProgramFilesError (a BadRequest) names
    the file at fault."""
    return ProgramSource.read(args.dir, manifest=args.manifest, ptx=args.ptx, cuda=args.cuda,
                              data=getattr(args, "data", None))


def _command(args: argparse.Namespace) -> Command:
    """What to ask of the fleet, everything that can be checked here checked first."""
    if args.cmd == "deploy":
        src = source(args)
        name: str = args.name or src.manifest.get("name") or ""  # none: refused by the spec's check, as a bad name
        spec = ProgramSpec(name=name, source=src, replicas=args.replicas, unique=args.unique,
                           strategy=args.strategy, gpu=args.gpu, node=args.node, hash=args.hash,
                           **({} if args.restart is None else {"restart": args.restart}))
        spec.check()

        async def deploy(fleet: Fleet) -> int:
            prog = await fleet.deploy(spec)
            if args.wait:
                prog = await fleet.wait(spec.name, running=spec.replicas, timeout=args.timeout)
            if args.json:
                return _print_json(prog)
            print(f"{spec.name} deployed: {spec.replicas} replica{'' if spec.replicas == 1 else 's'}, {spec.strategy}"
                  + (", every one running" if args.wait else " (meshd-mps fleet status shows where)"))
            return 0

        return deploy
    if args.cmd == "upgrade":
        src = source(args)

        async def upgrade(fleet: Fleet) -> int:
            prog = await fleet.upgrade(args.name, src, hash=args.hash)
            if args.json:
                return _print_json(prog)
            print(f"{args.name} upgraded on every replica")
            return 0

        return upgrade
    if args.cmd == "remove":
        async def remove(fleet: Fleet) -> int:
            await fleet.remove(args.name)
            print(f"{args.name} removed")
            return 0

        return remove
    if args.cmd == "call":
        try:
            asked = callio.request(args)
        except ClientError as e:
            raise BadRequest(str(e)) from e
        data = asked.encode("utf-8") if isinstance(asked, str) else asked

        async def call(fleet: Fleet) -> int:
            reply = await fleet.call(args.name, data, timeout=args.timeout, idempotent=args.idempotent)
            r = reply.replica
            if args.json:
                return _print_json({"hex": reply.data.hex(), "data": reply.data.decode("utf-8", "replace"),
                                    "replica": r, "via": reply.via})
            try:
                callio.respond(reply.data, args)
            except ClientError as e:
                raise BadRequest(str(e)) from e
            print(f"# {r.program}[{r.index}] on node {node(r)}, GPU {r.gpu}, slot {r.slot}, via {reply.via}",
                  file=sys.stderr)
            return 0

        return call
    if args.cmd == "events":
        async def events(fleet: Fleet) -> int:
            st = await fleet.status(args.name)
            if args.json:
                return _print_json(st.events)
            print(events_table(st.events), end="")
            return 0

        return events
    if args.cmd == "top":
        return _top(args)
    if args.cmd == "metrics":
        async def metrics(fleet: Fleet) -> int:
            sys.stdout.buffer.write(exposition(await fleet.status()))
            return 0

        return metrics
    return _status(args)


def _top(args: argparse.Namespace) -> Command:
    """``fleet top``: its options checked (BadRequest, exit 2) before the cluster is asked."""
    from meshd_mps.fleet.top import PROGRAM_HEAD, FleetTop
    from meshd_mps.serving.screen import need_rich, run, view_of

    need_rich()
    view = view_of(args.sort, args.reverse, args.filter, args.interval, PROGRAM_HEAD)

    async def top(fleet: Fleet) -> int:
        return await run(view, FleetTop(fleet, args.namespace).look, every=args.interval, once=args.once)

    return top


def _status(args: argparse.Namespace) -> Command:
    async def status(fleet: Fleet) -> int:
        st = await fleet.status(args.name)
        if args.json:
            return _print_json(st)
        if args.nodes:
            print(node_table(st.nodes), end="")
            return 0
        print(status_table(replicas(st)), end="", flush=True)
        for n in st.nodes:  # beside the rows (stderr): a node this fleet cannot use, and why
            if n.alive and n.reason:
                print(f"# node {n.name}: {n.reason}", file=sys.stderr, flush=True)
        if not args.watch:
            return 0
        watch = Watch(st)
        while True:  # until Ctrl-C, as kubectl get -w
            await asyncio.sleep(WATCH_EVERY)
            out = watch.changes(await fleet.status(args.name))
            if out:
                print(out, end="", flush=True)

    return status


def _print_json(obj: Any) -> int:
    print(json.dumps(as_json(obj), indent=2))
    return 0


def resources(socket: str | None, node: str | None = None, slots: int | None = None) -> int:
    """This node's capacity as Ray resources, read from its running daemon's status: the JSON that
    ``ray start --resources`` takes."""
    from meshd_mps.fleet.capacity import node_resources
    from meshd_mps.serving.client import Client

    try:
        status = Client(socket).status()
    except ClientError as e:
        print(f"meshd-mps: {e}", file=sys.stderr)
        return 1
    print(json.dumps(node_resources(status, node=node, slots=slots), sort_keys=True))
    return 0
