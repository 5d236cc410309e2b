"""What the tests are built on, one module per level, imported by test modules (which never
import one another; tests/unit/test_layers.py checks it):

- ``waits``: the one polling loop (``poll``, ``until``: cond, within, what, every);
- ``procs``: processes, fds and temporary files, read from /proc;
- ``sim``: images for the simulated GPU;  ``deadlines``: the tests' one table of deadlines;
- ``worker``: one ``meshd-mps worker`` process spoken to frame by frame (no supervisor);
- ``mps``: MPS mode's host-wide part on the stand-in daemon and one GPU's isolation (``MpsRig``),
  and what a dead run leaves of its control daemon;
- ``live``: supervisors that detach and adopt workers over one file mailbox (``LiveRig``);
- ``backend``: the example programs compiled for a ``Backend`` on the simulated GPU, and their beats;
- ``serve``: one ``meshd-mps serve`` subprocess (``Serve``), the CLI, metrics and leftovers;
- ``gpu``: what the real-GPU tests (tests/gpu) share.

Test bodies run both on the simulator and on the real GPU live in tests/cases/.
"""
