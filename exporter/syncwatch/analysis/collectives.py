"""Cost of the gradient all-reduce, Hockney (alpha-beta) model.

A message of ``n`` bytes between two endpoints costs ``alpha + n / beta``: ``alpha`` the per-message
latency (seconds), ``beta`` the bandwidth (bytes per second). Collectives are sums of such steps:

* ring all-reduce over ``P`` ranks: a reduce-scatter and an all-gather of ``P - 1`` steps each,
  every step moving ``n / P`` bytes: ``T = 2 (P - 1) (alpha + n / (P beta))``. The bandwidth term
  tends to ``2 n / beta`` whatever ``P``; the latency term grows linearly with ``P``.
* tree all-reduce (binomial tree reduce, then broadcast, unpipelined):
  ``T = 2 ceil(log2 P) (alpha + n / beta)``. Latency grows only logarithmically, but every level
  moves the whole message: it wins for small messages at large scale, the ring for large ones.
* hierarchical (two tiers): ring reduce-scatter and all-gather inside a node over NVLink among the
  ``L`` local ranks, and between them an all-reduce across nodes of each GPU's ``n / L`` shard,
  the ``L`` shards in parallel, each GPU on its own network interface (rail-optimized fabric).
"""

from __future__ import annotations

import math

ALGORITHMS = ("ring", "tree")


def ring_allreduce_seconds(nbytes: float, ranks: int, bandwidth: float, latency: float = 0.0) -> float:
    """``2 (P - 1) (alpha + n / (P beta))``; zero for a single rank."""
    if ranks <= 1:
        return 0.0
    return 2 * (ranks - 1) * (latency + nbytes / (ranks * bandwidth))


def tree_allreduce_seconds(nbytes: float, ranks: int, bandwidth: float, latency: float = 0.0) -> float:
    """``2 ceil(log2 P) (alpha + n / beta)``; zero for a single rank."""
    if ranks <= 1:
        return 0.0
    return 2 * math.ceil(math.log2(ranks)) * (latency + nbytes / bandwidth)


def allreduce_seconds(algorithm: str, nbytes: float, ranks: int, bandwidth: float,
                      latency: float = 0.0) -> float:
    if algorithm == "ring":
        return ring_allreduce_seconds(nbytes, ranks, bandwidth, latency)
    if algorithm == "tree":
        return tree_allreduce_seconds(nbytes, ranks, bandwidth, latency)
    raise ValueError(f"unknown all-reduce algorithm {algorithm!r} (expected one of {ALGORITHMS})")


def hierarchical_allreduce_seconds(nbytes: float, local_ranks: int, nodes: int, *,
                                   intra_bandwidth: float, intra_latency: float,
                                   inter_bandwidth: float, inter_latency: float,
                                   algorithm: str = "ring") -> tuple[float, float]:
    """(intra-node seconds, inter-node seconds) of a two-tier all-reduce of ``nbytes`` per GPU.

    Intra-node: ring reduce-scatter + all-gather over ``local_ranks`` = a ring all-reduce's cost.
    Inter-node: ``algorithm`` all-reduce of ``nbytes / local_ranks`` across ``nodes``.
    """
    local_ranks = max(1, local_ranks)
    intra = ring_allreduce_seconds(nbytes, local_ranks, intra_bandwidth, intra_latency)
    inter = allreduce_seconds(algorithm, nbytes / local_ranks, nodes, inter_bandwidth, inter_latency)
    return intra, inter
