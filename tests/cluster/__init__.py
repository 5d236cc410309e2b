"""The tests whose heaviest dependency is a real Ray cluster."""
