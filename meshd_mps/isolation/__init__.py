"""The isolation modes (blink: one context; MPS: a client per program) and their limits."""
