"""The Python spellings issue 31 replaced still work for one release (docs/api.md, "Words"):
``Programs(policy=)``, ``load/upgrade(expect=, policy=)``, ``call(within=)`` and ``Program.policy``
mean what ``restart``, ``hash`` and ``timeout`` mean; a wrong old ``expect`` is refused as a wrong
``hash`` is."""

from __future__ import annotations

import pytest

from meshd_mps.errors import HashMismatch
from meshd_mps.gpu.compiler import Manifest, image_hash
from meshd_mps.programs import Programs
from meshd_mps.restart import Policy

from .rigs.backend import example, open_sim


async def test_the_old_keywords_mean_the_new_ones():
    async with await open_sim() as b:
        progs = Programs(b, policy="never")
        man, ptx = example("echo")
        h = image_hash(ptx, Manifest.parse(man).param)
        with pytest.raises(HashMismatch):
            await progs.load(man, ptx, expect=h ^ 1)
        p = await progs.load(man, ptx, expect=h, policy="always")
        assert p.restart is Policy.ALWAYS and p.policy is Policy.ALWAYS and p.hash == h
        assert await progs.call("echo", b"old words", within=5.0) == b"old words"
        p = await progs.upgrade("echo", *example("echo"), expect=h, policy="never")
        assert p.restart is Policy.NEVER and p.upgrades == 1
        assert progs.restart is Policy.NEVER  # Programs(policy=): the default for what is loaded without one
        await progs.close()
