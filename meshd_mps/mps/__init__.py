"""NVIDIA MPS: the private control daemon, its server's clients, the stand-in."""
