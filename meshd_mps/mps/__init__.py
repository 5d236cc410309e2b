"""NVIDIA MPS: the private control daemon and its server's clients (the stand-in daemon that the tests
put first on PATH is meshd_mps/standin/, a layer below)."""
