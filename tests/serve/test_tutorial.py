"""docs/tutorial.md walked as written, on the simulated GPU: its daemon in "terminal 1", then every
line of its shell blocks and its Python block in "terminal 2", in order, in one shell; each must
succeed, and the answers it prints must be the tutorial's.  What the test adds, and nothing else:
the venv is this test's interpreter's, the checkout is seen through a temporary directory (its
``examples`` and ``.venv`` linked there, so that ``demo/`` is made there and not in the checkout),
and the daemon's socket and state dir are in that directory too (``XDG_RUNTIME_DIR``, systemd's
``STATE_DIRECTORY``)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from ..rigs.serve import leftovers
from ..rigs.waits import poll

pytestmark = pytest.mark.timeout(150)
REPO = Path(__file__).resolve().parents[2]
VENV = Path(sys.prefix)


def blocks() -> list[tuple[str, str]]:
    text = (REPO / "docs" / "tutorial.md").read_text()
    return [(m.group(1), m.group(2)) for m in re.finditer(r"```(sh|python)\n(.*?)```", text, re.S)]


def lines(code: str) -> list[str]:
    return [ln.split("  #", 1)[0].strip() for ln in code.splitlines() if ln.strip() and not ln.startswith("#")]


@pytest.mark.skipif(not (VENV / "bin" / "activate").exists(), reason="the tests do not run in a venv: the tutorial assumes one")
def test_the_tutorial_as_written(tmp):
    (first_kind, first), *rest = blocks()
    serve = lines(first)
    assert first_kind == "sh" and serve == [". .venv/bin/activate", "meshd-mps serve --gpu sim"], serve
    os.symlink(REPO / "examples", os.path.join(tmp, "examples"))
    os.symlink(VENV, os.path.join(tmp, ".venv"))
    env = {k: v for k, v in os.environ.items() if not k.startswith("MESHD_MPS_") and k != "CUDA_MPS_PIPE_DIRECTORY"}
    env |= {"XDG_RUNTIME_DIR": tmp, "STATE_DIRECTORY": os.path.join(tmp, "state"),
            "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}
    log = open(os.path.join(tmp, "serve.log"), "w")  # noqa: SIM115 - the daemon's, closed in finally
    daemon = subprocess.Popen(["bash", "-c", " && ".join(serve)], cwd=tmp, env=env, stdout=log, stderr=subprocess.STDOUT,
                              process_group=0)
    sock = os.path.join(tmp, "meshd-mps-sim.sock")
    try:
        poll(lambda: os.path.exists(sock) or daemon.poll() is not None, 60, "the daemon's socket")
        assert daemon.poll() is None, Path(tmp, "serve.log").read_text()
        script = ["set -e", ". .venv/bin/activate"]
        for kind, code in rest:
            if kind == "sh":
                script += [f"echo '$ {ln}'; {ln}" for ln in lines(code)]
            else:
                script += ["python - <<'PY'", code.rstrip(), "PY"]
        r = subprocess.run(["bash", "-c", "\n".join(script)], cwd=tmp, env=env, capture_output=True, text=True,
                           timeout=120)
        assert r.returncode == 0, f"{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
        out = r.stdout
        # Step 4: each query's own row first (inner product: a row against itself is its largest);
        # step 5: the two rows appended, and searched by the next query.
        assert re.search(r"^query 0: 5 \(", out, re.M) and re.search(r"^query 1: 42 \(", out, re.M), out
        assert "2 rows appended as rows 100000..100001" in out and "(100002 rows searched)" in out, out
        assert "Traceback" not in r.stderr, r.stderr
        assert not os.path.exists(os.path.join(tmp, "demo")), "the tutorial's last step removes its directory"
        os.killpg(daemon.pid, signal.SIGTERM)
        assert daemon.wait(30) == 0, Path(tmp, "serve.log").read_text()[-3000:]
    finally:
        if daemon.poll() is None:
            os.killpg(daemon.pid, signal.SIGKILL)
            daemon.wait()
        log.close()
    poll(lambda: not leftovers([sock, tmp]), 10.0, lambda: f"nothing of the daemon left: {leftovers([sock, tmp])}")
