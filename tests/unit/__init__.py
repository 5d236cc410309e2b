"""The tests whose heaviest dependency is pure units: no process, no daemon."""
