"""What a new user meets first: each message names the thing that is wrong."""

from __future__ import annotations

import os

import pytest

from meshd_mps.state.program_files import ProgramFilesError, program_body

from ..rigs.serve import cli


def test_a_missing_program_directory_is_named_as_missing(tmp):
    with pytest.raises(ProgramFilesError, match=r"nothere: no such directory$"):
        program_body(os.path.join(tmp, "nothere"))
    open(os.path.join(tmp, "file"), "w").close()
    with pytest.raises(ProgramFilesError, match=r"file: not a directory \(a program directory holds manifest.json"):
        program_body(os.path.join(tmp, "file"))


def test_the_cli_says_it_in_one_line(tmp):
    r = cli("load", os.path.join(tmp, "nothere"), "--socket", os.path.join(tmp, "s.sock"))
    assert r.returncode != 0 and r.stderr.strip().endswith("nothere: no such directory"), r.stderr
    assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_a_file_that_is_not_ptx_is_said_to_be_so():
    """nvJitLink's log ran our input's name into its words ("NVJITLINK_INPUT_PTXprogram.ptx")."""
    from meshd_mps.base.errors import CompileError
    from meshd_mps.gpu.compiler import ptx_to_cubin

    with pytest.raises(CompileError) as e:
        ptx_to_cubin(b"# README\nnot a line of PTX\n", "sm_90", 0)
    assert str(e.value).startswith("jit: not PTX text (the file given as PTX is something else; nvJitLink: "), e.value
    assert "NVJITLINK_INPUT_PTXprogram.ptx" not in str(e.value)

