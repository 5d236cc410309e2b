"""The worker-process side of meshd-mps: one MPS client per program image.

``python -m workers`` (and ``meshd-mps worker``) runs :func:`workers.main.main` through
:func:`workers.start.run`; it speaks the frame
protocol of :mod:`meshd_mps.frames` on stdin/stdout and drives a GPU
(:mod:`workers.cuda_gpu`, or the explicit simulation :mod:`workers.sim_gpu`).
"""
