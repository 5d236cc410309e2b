"""What the install says: pyproject.toml in the form today's setuptools reads without a warning."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_license_is_an_spdx_expression_which_the_build_backend_reads():
    """A TOML table (``{text = ...}``) made every install warn that it is deprecated (PEP 639); the
    string form needs setuptools 77 or later, so the build requires that."""
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert meta["project"]["license"] == "Apache-2.0"
    (req,) = [r for r in meta["build-system"]["requires"] if r.startswith("setuptools")]
    m = re.fullmatch(r"setuptools>=(\d+)(\.\d+)*", req)
    assert m is not None and int(m.group(1)) >= 77, req
