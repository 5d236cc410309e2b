"""What ``meshd-mps call`` and ``meshd-mps fleet call`` send and show: the request from DATA (text,
or hex digits with ``--hex``) or from a file as it is (``--in FILE``, ``-`` for standard input), and
the response printed (text, or hex with ``--hex``) or written to a file as it is (``--out FILE``,
``-`` for standard output).  A file's bytes travel in the binary form of the call (any size the
program declares: its manifest's ``max_request`` and ``max_response``)."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from meshd_mps.serving.client import Client, ClientError, read_input


def add_options(p: argparse.ArgumentParser) -> None:
    """DATA (optional where ``--in`` gives the request), ``--hex``, ``--in FILE`` and ``--out FILE``."""
    p.add_argument("data", metavar="DATA", nargs="?", help="the request: text (UTF-8), or hex digits with --hex")
    p.add_argument("--hex", action="store_true", help="DATA is hex; the response is printed in hex")
    p.add_argument("--in", dest="infile", metavar="FILE",
                   help="the request: FILE's bytes as they are, instead of DATA (-: standard input)")
    p.add_argument("--out", dest="outfile", metavar="FILE",
                   help="the response's bytes as they are into FILE, instead of printed (-: standard output)")


def binary(args: argparse.Namespace) -> bool:
    """The call goes in the binary form: a file gives the request or takes the response."""
    return args.infile is not None or args.outfile is not None


def request(args: argparse.Namespace) -> bytes | str:
    """The request's bytes (a str: DATA's text, for the JSON form's ``data``); ClientError for none,
    both, hex that is not, a file that cannot be read or is over the daemon's 64 MiB."""
    if (args.data is None) == (args.infile is None):
        raise ClientError("give the request as DATA or as --in FILE (one of them)")
    if getattr(args, "json", False) and binary(args):
        raise ClientError("--json prints the JSON form's answer; --in and --out make the call binary: drop one")
    if args.infile is not None:
        try:
            return read_input(args.infile)
        except ClientError as e:
            raise ClientError(f"--in {e}") from e
    if args.hex:
        try:
            return bytes.fromhex(args.data)
        except ValueError as e:
            raise ClientError(f"DATA: not hex: {e}") from e
    return str(args.data) if not binary(args) else str(args.data).encode("utf-8")


def respond(data: bytes, args: argparse.Namespace) -> None:
    """The response written to ``--out`` as it is, else printed (in hex with ``--hex``)."""
    if args.outfile is None:
        print(data.hex() if args.hex else data.decode("utf-8", "replace"))
        return
    try:
        if args.outfile == "-":
            sys.stdout.buffer.write(data)
            sys.stdout.flush()
        else:
            with open(args.outfile, "wb") as f:
                f.write(data)
    except OSError as e:
        raise ClientError(f"--out {args.outfile}: {e.strerror or e}") from e


def call(client: Client, args: argparse.Namespace) -> dict[str, Any] | None:
    """``meshd-mps call``: the request sent in the form its options ask for; the JSON form's answer
    where ``--json`` asks for it, else None (the response printed or written already)."""
    data = request(args)
    if binary(args):
        respond(client.call_bytes(args.name, data if isinstance(data, bytes) else data.encode(), args.timeout), args)
        return None
    ans = client.call(args.name, data, args.timeout)
    if args.json:
        return ans
    print(ans["hex"] if args.hex else ans["data"])
    return None
