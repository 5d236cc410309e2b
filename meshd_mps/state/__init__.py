"""What meshd-mps keeps across its own restarts: the desired state on disk (``store``)
and the ``--config`` file (``config``).  Nothing here runs a program: serve reads and writes these."""
