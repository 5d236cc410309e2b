"""Which loop each serving example runs on the simulated GPU, with the memory it reads bound: echo's
(its ring alone), peek's (its data), knn's (its data, its payload region and its blocks)."""

from __future__ import annotations

import functools

from .sim_kernels import Turn, View, echo_turn, peek_turn
from .sim_knn import knn_turn


def turn_of(kind: str, data: View, region: View, nodes: int) -> Turn | None:
    """The example's turn (None: heartbeat, which serves no ring)."""
    if kind == "echo":
        return echo_turn
    if kind == "peek":
        return functools.partial(peek_turn, data=data)
    if kind == "knn":
        return functools.partial(knn_turn, data=data, region=region, nodes=nodes)
    return None
