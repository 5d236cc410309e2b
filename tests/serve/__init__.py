"""The tests whose heaviest dependency is a meshd-mps serve subprocess, the CLI, a real Prometheus, tmux."""
