"""meshd-mps serve: the control API, its metrics, the client and the CLI."""
