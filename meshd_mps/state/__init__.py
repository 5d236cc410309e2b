"""What meshd-mps keeps across its own restarts (issue 17): the desired state on disk (``store``)
and the ``--config`` file (``config``).  Nothing here runs a program: serve reads and writes these."""
