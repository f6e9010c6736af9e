"""Topology scoring: which set of free GPUs is best connected (R-AL-2).

Rules:
- A pair of GPUs scores ``NVLINK_WEIGHT`` per NVLink link between them plus
  PCIe points by their common ancestor: same board 5 > same switch 4 >
  several switches 3 > same host bridge 2 > same NUMA node 1 > across
  sockets / unknown 0. NVLink always outweighs PCIe (one link = 10 > 5).
- A set scores the sum over its pairs. ``allocate_best`` returns the
  ``count`` free GPUs with the highest score; ties go to the lowest minors
  (the lexicographically smallest sorted list). With no topology facts every
  set scores 0, so the answer is Mesos' lowest-first.
- ``include`` (the kubelet's must-include devices): GPUs the set must
  hold. The answer is the best-scoring set of ``count`` that contains them
  all (each other GPU also scores its pairs with them), by the same search
  and tie rule; without topology facts, ``include`` plus the lowest others.
  ``count`` smaller than ``include`` is a ``ValueError``.
- Search: exhaustive (depth-first in lexicographic order, pruned with an
  upper bound) while C(free, count) <= ``EXHAUSTIVE_LIMIT``; beyond that a
  greedy growth from every seed GPU; beyond ``GREEDY_LIMIT`` free GPUs,
  lowest-first. Pure functions, no I/O.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

from actors.gpu import Gpu
from actors.nvml import (
    TOPOLOGY_HOSTBRIDGE,
    TOPOLOGY_INTERNAL,
    TOPOLOGY_MULTIPLE,
    TOPOLOGY_NODE,
    TOPOLOGY_SINGLE,
    NodeInventory,
)

__all__ = ["NVLINK_WEIGHT", "PCIE_POINTS", "PairScores", "pair_score", "allocate_best"]

NVLINK_WEIGHT = 10
PCIE_POINTS = {
    TOPOLOGY_INTERNAL: 5,
    TOPOLOGY_SINGLE: 4,
    TOPOLOGY_MULTIPLE: 3,
    TOPOLOGY_HOSTBRIDGE: 2,
    TOPOLOGY_NODE: 1,
}
EXHAUSTIVE_LIMIT = 20_000
GREEDY_LIMIT = 128


def pair_score(level: int | None, nvlinks: int) -> int:
    """The score of one pair: NVLink links and PCIe level (see module rules)."""
    return NVLINK_WEIGHT * max(0, nvlinks) + PCIE_POINTS.get(level, 0)


class PairScores:
    """Pair scores between the GPUs an allocator manages (immutable)."""

    def __init__(self, gpus: Iterable[Gpu], scores: dict[tuple[Gpu, Gpu], int] | None = None) -> None:
        self.gpus = sorted(set(gpus))
        self._position = {gpu: i for i, gpu in enumerate(self.gpus)}
        size = len(self.gpus)
        self.matrix = [[0] * size for _ in range(size)]
        for (a, b), value in (scores or {}).items():
            if a in self._position and b in self._position and a != b:
                i, j = self._position[a], self._position[b]
                self.matrix[i][j] = self.matrix[j][i] = int(value)
        self.has_topology = any(any(row) for row in self.matrix)

    @classmethod
    def none(cls, gpus: Iterable[Gpu]) -> "PairScores":
        """No topology facts: every pair scores 0 (lowest-first)."""
        return cls(gpus)

    @classmethod
    def from_inventory(cls, inventory: NodeInventory, gpus: Iterable[Gpu] | None = None) -> "PairScores":
        """Scores from NVML's topology and NVLink facts, for ``gpus`` (default: all)."""
        by_gpu = inventory.by_gpu()
        wanted = sorted(set(gpus) if gpus is not None else by_gpu)
        scores: dict[tuple[Gpu, Gpu], int] = {}
        for x, a in enumerate(wanted):
            info_a = by_gpu.get(a)
            if info_a is None:
                continue
            for b in wanted[x + 1 :]:
                info_b = by_gpu.get(b)
                if info_b is None:
                    continue
                level = inventory.level(info_a.index, info_b.index)
                links = info_a.nvlink.get(info_b.index, 0)
                scores[(a, b)] = pair_score(level, links)
        return cls(wanted, scores)

    def score(self, a: Gpu, b: Gpu) -> int:
        """The score of one pair (0 for unknown GPUs or a GPU with itself)."""
        i, j = self._position.get(a), self._position.get(b)
        if i is None or j is None:
            return 0
        return self.matrix[i][j]

    def total(self, gpus: Iterable[Gpu]) -> int:
        """The score of a set: the sum over its pairs."""
        rows = [self._position[g] for g in sorted(set(gpus)) if g in self._position]
        return sum(self.matrix[i][j] for x, i in enumerate(rows) for j in rows[x + 1 :])

    def positions(self, gpus: Sequence[Gpu]) -> list[int]:
        return [self._position[g] for g in gpus]


def allocate_best(free: Iterable[Gpu], count: int, scores: PairScores, include: Iterable[Gpu] = ()) -> list[Gpu]:
    """The best-connected ``count`` GPUs of ``free`` (sorted), holding every
    GPU of ``include`` (see module rules)."""
    required = sorted(set(include))
    candidates = sorted(set(free) | set(required))
    if count < len(required):
        raise ValueError(f"Cannot choose {count} GPUs that include the {len(required)} GPUs {required}")
    if count <= 0:
        return []
    if count >= len(candidates):
        return candidates
    if required:
        return _best_with(candidates, required, count, scores)
    known = [g for g in candidates if g in scores._position]
    if not scores.has_topology or count == 1 or len(known) < len(candidates):
        return candidates[:count]
    rows = scores.positions(candidates)
    matrix = [[scores.matrix[i][j] for j in rows] for i in rows]
    if not any(any(row) for row in matrix):
        return candidates[:count]
    n = len(candidates)
    if math.comb(n, count) <= EXHAUSTIVE_LIMIT:
        chosen = _exhaustive(matrix, count)
    elif n <= GREEDY_LIMIT:
        chosen = _greedy(matrix, count)
    else:
        return candidates[:count]
    return [candidates[i] for i in chosen]


def _best_with(candidates: list[Gpu], required: list[Gpu], count: int, scores: PairScores) -> list[Gpu]:
    """``required`` plus the ``count - len(required)`` others that score best
    with each other and with ``required`` (each other's pairs with the
    required GPUs are its bonus)."""
    taken = set(required)
    others = [g for g in candidates if g not in taken]
    wanted = count - len(required)
    lowest = sorted(required + others[:wanted])
    if wanted == 0 or not scores.has_topology or any(g not in scores._position for g in candidates):
        return lowest
    rows = scores.positions(others)
    fixed = scores.positions(required)
    matrix = [[scores.matrix[i][j] for j in rows] for i in rows]
    bonus = [sum(scores.matrix[i][r] for r in fixed) for i in rows]
    if not any(bonus) and not any(any(row) for row in matrix):
        return lowest
    if math.comb(len(others), wanted) <= EXHAUSTIVE_LIMIT:
        chosen = _exhaustive(matrix, wanted, bonus)
    elif len(others) <= GREEDY_LIMIT:
        chosen = _greedy(matrix, wanted, bonus)
    else:
        return lowest
    return sorted(required + [others[i] for i in chosen])


def _exhaustive(matrix: list[list[int]], count: int, bonus: list[int] | None = None) -> list[int]:
    """Best subset by depth-first search in lexicographic order, pruned;
    ``bonus[i]`` is added when ``i`` is chosen."""
    n = len(matrix)
    best_pair = max(max(row) for row in matrix)
    best_bonus = max(bonus) if bonus else 0
    best: list[int] = list(range(count))
    best_score = sum(matrix[i][j] for x, i in enumerate(best) for j in best[x + 1 :])
    if bonus:
        best_score += sum(bonus[i] for i in best)
    chosen: list[int] = []

    def search(start: int, partial: int) -> None:
        nonlocal best, best_score
        k = len(chosen)
        if k == count:
            if partial > best_score:
                best, best_score = list(chosen), partial
            return
        remaining = count - k
        # Pairs still to add: among the remaining and between them and the chosen.
        bound = best_pair * (remaining * (remaining - 1) // 2 + remaining * k) + best_bonus * remaining
        if partial + bound <= best_score:
            return  # cannot beat (ties go to the earlier, lower set)
        for i in range(start, n - remaining + 1):
            row = matrix[i]
            gain = bonus[i] if bonus else 0
            for j in chosen:
                gain += row[j]
            chosen.append(i)
            search(i + 1, partial + gain)
            chosen.pop()

    search(0, 0)
    return best


def _greedy(matrix: list[list[int]], count: int, bonus: list[int] | None = None) -> list[int]:
    """Grow a set from every seed by the best gain; keep the best (ties:
    lowest). With ``bonus`` (the pairs with GPUs already required) one
    growth from nothing, starting from those gains."""
    n = len(matrix)
    if bonus is not None:
        chosen: list[int] = []
        taken = [False] * n
        gains = list(bonus)
        while len(chosen) < count:
            pick = max((c for c in range(n) if not taken[c]), key=lambda c: (gains[c], -c))
            chosen.append(pick)
            taken[pick] = True
            row = matrix[pick]
            for c in range(n):
                gains[c] += row[c]
        return sorted(chosen)
    best: list[int] | None = None
    best_score = -1
    for seed in range(n):
        chosen = [seed]
        taken = [False] * n
        taken[seed] = True
        gains = list(matrix[seed])
        score = 0
        while len(chosen) < count:
            pick, pick_gain = -1, -1
            for c in range(n):
                if not taken[c] and gains[c] > pick_gain:
                    pick, pick_gain = c, gains[c]
            chosen.append(pick)
            taken[pick] = True
            score += pick_gain
            row = matrix[pick]
            for c in range(n):
                gains[c] += row[c]
        ordered = sorted(chosen)
        if score > best_score or (score == best_score and best is not None and ordered < best):
            best, best_score = ordered, score
    return best or list(range(count))
