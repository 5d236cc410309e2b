"""The package's shape, checked: imports point down the layers of docs/architecture.md, never in a
circle, and no module is over 500 lines unless docs/architecture.md says why (meshd_mps/, workers/
and scripts/).

Read from the source (ast), not by importing it: an import inside a function counts as much as one
at the top, and one under ``if TYPE_CHECKING`` too (a type drawn from above is a dependency on it).
"""

from __future__ import annotations

import ast
import re
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("meshd_mps", "workers", "scripts")

#: Each module's layer, by the longest prefix that names it: a module imports only from its own
#: layer or lower ones.  The same table is drawn in docs/architecture.md ("Layers and modules").
LAYERS: dict[str, int] = {
    # 11: the scripts (probes, device runs): above everything, as the command is; they may import
    # any of meshd_mps and workers, and nothing imports them
    "scripts": 11,
    # 10: the command's entry: `fleet ...` to the fleet's CLI, the rest to the node's (meshd_mps/cli.py)
    "meshd_mps.cli": 10,
    "meshd_mps.__main__": 10,
    # 8: the surfaces: the daemon, its CLI and API, the bench, the package's front door
    "meshd_mps": 8,
    "meshd_mps.serving": 8,
    "meshd_mps.bench": 8,
    # 9: the fleet, above one node's daemon and its client
    "meshd_mps.fleet": 9,
    # 7: what outlives a restart (the desired state kept and restored)
    "meshd_mps.state": 7,
    # 6: named programs on slots
    "meshd_mps.programs": 6,
    # 5: the backend facade
    "meshd_mps.backend": 5,
    # 4: the modes, one GPU each
    "meshd_mps.isolation": 4,
    # 3: the processes: the MPS daemon and its clients, the worker processes, the neighbours
    "meshd_mps.mps": 3,
    "meshd_mps.supervision": 3,
    "meshd_mps.neighbours": 3,
    # 2: the worker process's own code, the GPU without a context, what both sides share
    "workers": 2,
    "meshd_mps.gpu": 2,
    "meshd_mps.protocol": 2,
    "meshd_mps.standin": 2,  # the stand-in daemon's model, which the simulated GPU reads
    # 1: imported by every layer; pure decisions and tables, in their own folder
    "meshd_mps.base": 1,
}

MAX_LINES = 500



def modules() -> dict[str, Path]:
    out: dict[str, Path] = {}
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


def layer(mod: str) -> int:
    best = max((p for p in LAYERS if mod == p or mod.startswith(p + ".")), key=len, default=None)
    assert best is not None, f"{mod}: no layer in LAYERS (add it there and to docs/architecture.md)"
    return LAYERS[best]


def imports(path: Path, mods: dict[str, Path]) -> set[str]:
    """The modules of ours that ``path`` imports (a name imported from a package that is a module
    of its own counts as that module)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        names: list[str] = []
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in mods else node.module for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        found.update(n for n in names if n.split(".")[0] in PACKAGES)
    return found


def graph() -> dict[str, set[str]]:
    mods = modules()
    out: dict[str, set[str]] = {}
    for m, path in mods.items():
        deps = set()
        for n in imports(path, mods):
            while n not in mods and "." in n:  # `import a.b.c` where c is a name: the module a.b
                n = n.rsplit(".", 1)[0]
            if n in mods and n != m:
                deps.add(n)
        out[m] = deps
    return out


def upward(g: dict[str, set[str]]) -> set[tuple[str, str]]:
    """Each (module, import) that points to a higher layer (a package's own modules aside)."""
    return {(m, d) for m, ds in g.items() for d in ds
            if layer(d) > layer(m) and not m.startswith(d + ".") and d not in PACKAGES}


def cycles(g: dict[str, set[str]]) -> set[tuple[str, ...]]:
    """Every cycle a depth-first walk meets, each as its modules rotated to start at the least."""
    found: set[tuple[str, ...]] = set()
    state: dict[str, int] = {}  # 1: on the path, 2: done
    path: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        path.append(m)
        for d in sorted(g.get(m, ())):
            if state.get(d) == 1:
                c = path[path.index(d):]
                i = c.index(min(c))
                found.add(tuple(c[i:] + c[:i]))
            elif d not in state:
                visit(d)
        path.pop()
        state[m] = 2

    for m in sorted(g):
        if m not in state:
            visit(m)
    return found


def test_imports_point_down() -> None:
    up = sorted(upward(graph()))
    assert not up, "imports that point up:\n" + "\n".join(
        f"{m} (layer {layer(m)}) imports {d} (layer {layer(d)})" for m, d in up)


def test_no_import_cycles() -> None:
    """No module reaches itself through its imports (a package's __init__ importing its own modules
    is not a cycle unless one of them imports the package back)."""
    found = sorted(cycles(graph()))
    assert not found, "import cycles:\n" + "\n".join(" -> ".join([*c, c[0]]) for c in found)


def test_modules_are_small_or_say_why() -> None:
    """Over MAX_LINES lines only where docs/architecture.md names the module, with its reason, in
    its section "Modules over 500 lines"."""
    doc = (ROOT / "docs" / "architecture.md").read_text()
    m = re.search(r"^## Modules over 500 lines\n(.*?)(?=^## |\Z)", doc, re.M | re.S)
    excused = set(re.findall(r"`([\w/]+\.py)`", m.group(1))) if m else set()
    big = {str(p.relative_to(ROOT)): n for p in modules().values() if (n := len(p.read_text().splitlines())) > MAX_LINES}
    unexplained = {p: n for p, n in big.items() if p not in excused}
    assert not unexplained, f"modules over {MAX_LINES} lines that docs/architecture.md does not explain: {unexplained}"
    stale = excused - set(big)
    assert not stale, f"explained as over {MAX_LINES} lines, and no longer are: {stale}"


def test_the_checks_see_a_violation(tmp_path: Path) -> None:
    """The scans are not blind: imports are read, and an upward import and a cycle are found."""
    (tmp_path / "a.py").write_text("from meshd_mps import backend\nimport meshd_mps.serving.cli\n")
    mods = {"meshd_mps.backend": tmp_path, "meshd_mps.serving.cli": tmp_path}
    assert imports(tmp_path / "a.py", mods) == {"meshd_mps.backend", "meshd_mps.serving.cli"}
    g = {"meshd_mps.backend": {"meshd_mps.serving.cli"}, "meshd_mps.serving.cli": {"meshd_mps.programs"},
         "meshd_mps.programs": {"meshd_mps.backend"}, "meshd_mps.base.errors": set()}
    assert upward(g) == {("meshd_mps.backend", "meshd_mps.serving.cli")}
    assert cycles(g) == {("meshd_mps.backend", "meshd_mps.serving.cli", "meshd_mps.programs")}
    assert cycles({"meshd_mps.base.errors": set()}) == set()


# ---- the tests' own shape: no test module imports another ----------------------------------------


def imported_modules(path: Path, root: Path = ROOT) -> set[str]:
    """The dotted names of the modules ``path`` imports (relative imports resolved against its
    package under ``root``; ``from P import m`` counts as P.m as well as P)."""
    here = list(path.relative_to(root).with_suffix("").parts[:-1])
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = here[: len(here) - node.level + 1] if node.level else []
            mod = ".".join([*base, *(node.module.split(".") if node.module else [])])
            out.add(mod)
            out |= {f"{mod}.{a.name}" for a in node.names}
    return out


def imports_of_test_modules(root: Path = ROOT) -> dict[str, set[str]]:
    """For every module under tests/ (rigs, cases and tests/gpu too): the test modules
    (``tests...test_*``) it imports."""
    found = {}
    for p in sorted((root / "tests").rglob("*.py")):
        bad = {m for m in imported_modules(p, root) if m.startswith("tests.") and m.split(".")[-1].startswith("test_")}
        if bad:
            found[str(p.relative_to(root))] = bad
    return found


def test_no_test_module_imports_another() -> None:
    """A test module imports rigs (tests/rigs/), shared cases (tests/cases/) and fixtures
    (conftest.py), never another test module: what two of them share lives in one of those."""
    found = imports_of_test_modules()
    assert not found, "test modules imported (move what they share to tests/rigs/ or tests/cases/):\n" + "\n".join(
        f"{p} imports {', '.join(sorted(ms))}" for p, ms in found.items())


def test_the_test_import_check_sees_one(tmp_path: Path) -> None:
    """The scan is not blind: relative, absolute and ``from . import`` imports of a test module are found."""
    (tmp_path / "tests" / "gpu").mkdir(parents=True)
    (tmp_path / "tests" / "rigs").mkdir()
    (tmp_path / "tests" / "test_a.py").write_text("from .test_b import x\nfrom .rigs.serve import Serve\n"
                                                  "import aiohttp.test_utils\n")  # not one of ours
    (tmp_path / "tests" / "test_c.py").write_text("from . import test_b\nimport tests.test_d\nfrom .conftest import sim\n")
    (tmp_path / "tests" / "gpu" / "test_e.py").write_text("from ..test_b import y\nfrom .test_f import z\n")
    (tmp_path / "tests" / "rigs" / "ok.py").write_text("from .waits import poll\nfrom ..cases.x import y\n")
    assert imports_of_test_modules(tmp_path) == {
        "tests/test_a.py": {"tests.test_b"},
        "tests/test_c.py": {"tests.test_b", "tests.test_d"},
        "tests/gpu/test_e.py": {"tests.test_b", "tests.gpu.test_f"},
    }


# ---- the code says why, never when ---------------------------------------------------------------

#: Where the project's Python lives: every one of its comments and docstrings is checked.
SOURCES = ("meshd_mps", "workers", "scripts", "examples", "tests")
#: A tracker's number, a date or a time of day: history, which docs/runs and the commits keep, not the code.
WHEN = re.compile(r"\b" + "issues?" + r" \d+\b|\b20\d\d-[01]\d-[0-3]\d\b|\b[0-2]\d:[0-5]\d UTC\b", re.I)


def when_said(path: Path) -> list[str]:
    """Each comment or triple-quoted string of ``path`` that names an issue or a date, as
    ``line: text``."""
    out = []
    with path.open("rb") as f:
        for tok in tokenize.tokenize(f.readline):
            quoted = tok.type == tokenize.STRING and tok.string.lstrip("rbuRBU")[:3] in ('"""', "'''")
            said = tok.type == tokenize.COMMENT or quoted
            if said and (m := WHEN.search(tok.string)):
                out.append(f"{tok.start[0]}: {m.group(0)}")
    return out


def test_comments_and_docstrings_say_why_never_when() -> None:
    """No issue number and no date in a comment or docstring: the reason stays, its history lives
    in docs/runs and the commits (a plain string, a test's data, may hold a date)."""
    found = {str(p.relative_to(ROOT)): w for d in SOURCES for p in sorted((ROOT / d).rglob("*.py"))
             if ".venv" not in p.parts and (w := when_said(p))}
    assert not found, "comments or docstrings that say when:\n" + "\n".join(f"{p}: {w}" for p, w in found.items())


def test_the_when_check_sees_one(tmp_path: Path) -> None:
    """The scan is not blind: a comment's issue and a docstring's date are found, a plain string's date is not."""
    p = tmp_path / "m.py"
    p.write_text('"""Made for Issue 12."""\nX = "2026-12-06"  # fine\n\ndef f():\n    """Seen 2026-12-03."""\n# see issue 4\n'
                 '# ran at 18:04 UTC\n')
    assert when_said(p) == ["1: Issue 12", "5: 2026-12-03", "6: issue 4", "7: 18:04 UTC"]
