"""What a new user met, mended and kept so: a file given as PTX that is not PTX is named; the docs say
that the same signal again within ``Deadlines.signal_echo`` is the same stop; the worker's synopsis
in docs/protocol.md names every option a worker takes (``--examples``, which every simulated worker
is given, was missing)."""

from __future__ import annotations

import re
import subprocess
import sys

from meshd_mps.base.deadlines import DEFAULT

from ..rigs.serve import EXAMPLES, REPO, cli, env


def test_a_file_given_as_ptx_that_is_not_ptx_is_named(tmp):
    """Refused before any daemon is asked (there is none here): the file and why, in one line."""
    for args in (["--manifest", str(EXAMPLES / "echo" / "manifest.json"), "--ptx", "README.md"],
                 ["--ptx", "README.md", str(EXAMPLES / "echo")]):
        r = cli("load", "--socket", f"{tmp}/none.sock", *args)
        assert r.returncode == 1, r
        assert r.stderr == ("meshd-mps: README.md: not PTX (no .version directive, with which every PTX file begins);"
                            " give a program's CUDA C with --cuda\n"), r.stderr


def test_operations_says_the_same_signal_again_soon_is_the_same_stop():
    text = " ".join((REPO / "docs" / "operations.md").read_text().split())
    assert (f"The same signal again within {DEFAULT.signal_echo:g} s of the first (`Deadlines.signal_echo`) is not a"
            " second one but the same stop") in text


def test_the_workers_synopsis_names_every_option_it_takes():
    r = subprocess.run([sys.executable, "-m", "workers", "--help"], capture_output=True, text=True, env=env(), cwd=REPO,
                       timeout=60)
    assert r.returncode == 0, r.stderr
    options = set(re.findall(r"(?<![\w-])--[a-z][a-z-]+", r.stdout)) - {"--help"}
    assert {"--examples", "--listen", "--hold", "--mailbox"} <= options, options
    doc = (REPO / "docs" / "protocol.md").read_text()
    synopsis = " ".join(doc.split("A worker is started as `", 1)[1].split("` (`supervision/argv.py`", 1)[0].split())
    assert synopsis.startswith("python -m workers --mailbox PATH"), synopsis
    missing = sorted(o for o in options if o not in synopsis)
    assert not missing, f"docs/protocol.md's worker synopsis lacks {missing}: {synopsis}"
