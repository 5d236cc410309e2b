"""The tests whose heaviest dependency is in-process rigs: a Backend, Programs, workers over pipes, the stand-in."""
