"""The bottom layer (layer 1 of docs/architecture.md): the tables and pure decisions that every
other layer imports (the errors, the deadlines, the defaults, names, strict JSON, the log's setup,
the event loop's choice, a fault's verdict, the restart and restore policies, a call's counts).

Nothing here imports from above it, so that a worker process, a client and the daemon all read
the same tables without importing the daemon.
"""
