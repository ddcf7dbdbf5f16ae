"""Cutting a sequence of layers into consecutive stages: shared by mp and pipeline."""

from __future__ import annotations


def partition(
    weights: list[int], parts: int, *, weighted_parts: bool = False, ties_to_later: bool = False
) -> list[int]:
    """Sizes of `parts` consecutive non-empty groups of `weights` with the smallest largest sum.

    The classic linear-partition dynamic programme: best[k][i] is the smallest
    possible largest group when the first i weights form k groups.
    `weighted_parts`: every group must have a non-zero sum (a pipeline stage
    of only activations would have nothing to train). `ties_to_later`: among
    equally good cuts take the latest, so zero-weight layers stay with the
    group before them.
    """
    n = len(weights)
    if not 1 <= parts <= n:
        raise ValueError(f"cannot cut {n} items into {parts} non-empty groups")
    prefix = [0]
    for w in weights:
        prefix.append(prefix[-1] + w)
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(parts + 1)]
    cut = [[0] * (n + 1) for _ in range(parts + 1)]
    best[0][0] = 0
    for k in range(1, parts + 1):
        for i in range(k, n + 1):
            for j in range(k - 1, i):  # the last group is weights[j:i]
                group = prefix[i] - prefix[j]
                cost = max(best[k - 1][j], group if group or not weighted_parts else inf)
                if cost < best[k][i] or (ties_to_later and cost == best[k][i]):
                    best[k][i], cut[k][i] = cost, j
    sizes, i = [], n
    for k in range(parts, 0, -1):
        sizes.append(i - cut[k][i])
        i = cut[k][i]
    return sizes[::-1]
