"""Topology scoring (R-AL-2): the best-connected set, lowest minors on ties."""

from __future__ import annotations

import itertools

from hypothesis import given, settings
from hypothesis import strategies as st

from actors.allocator import NVLINK_WEIGHT, PairScores, allocate_best, pair_score
from actors.allocator import _topology
from actors.gpu import Gpu
from actors.nvml import TOPOLOGY_HOSTBRIDGE, TOPOLOGY_INTERNAL, TOPOLOGY_MULTIPLE, TOPOLOGY_NODE
from actors.nvml import TOPOLOGY_SINGLE, TOPOLOGY_SYSTEM, SimulatedNvml, read_inventory


def g(*minors: int) -> list[Gpu]:
    return [Gpu(195, m) for m in minors]


def test_pair_scores_rank_nvlink_then_pcie_levels():
    levels = [TOPOLOGY_INTERNAL, TOPOLOGY_SINGLE, TOPOLOGY_MULTIPLE, TOPOLOGY_HOSTBRIDGE, TOPOLOGY_NODE, TOPOLOGY_SYSTEM]
    scores = [pair_score(level, 0) for level in levels]
    assert scores == sorted(scores, reverse=True) and len(set(scores)) == len(scores)
    assert pair_score(None, 0) == pair_score(TOPOLOGY_SYSTEM, 0) == 0
    assert pair_score(TOPOLOGY_SYSTEM, 1) > pair_score(TOPOLOGY_INTERNAL, 0)  # NVLink outweighs PCIe
    assert pair_score(TOPOLOGY_SYSTEM, 4) == 4 * NVLINK_WEIGHT


def test_ties_go_to_the_lowest_minors():
    gpus = g(0, 1, 2, 3)
    scores = PairScores(gpus, {(Gpu(195, 0), Gpu(195, 1)): 5, (Gpu(195, 2), Gpu(195, 3)): 5})
    assert allocate_best(gpus, 2, scores) == g(0, 1)
    assert allocate_best(g(1, 2, 3), 2, scores) == g(2, 3)
    assert allocate_best(gpus, 0, scores) == [] and allocate_best(gpus, 9, scores) == gpus


def test_scores_come_from_the_inventory():
    nvml = SimulatedNvml.from_text(
        "[[gpus]]\nnuma_node = 0\nnvlink = { '1' = 2 }\n[[gpus]]\nnuma_node = 0\n[[gpus]]\nnuma_node = 1\n"
    )
    nvml.init()
    scores = PairScores.from_inventory(read_inventory(nvml))
    assert scores.score(Gpu(195, 0), Gpu(195, 1)) == 2 * NVLINK_WEIGHT + pair_score(TOPOLOGY_NODE, 0)
    assert scores.score(Gpu(195, 0), Gpu(195, 2)) == 0
    assert scores.total(g(0, 1, 2)) == scores.score(Gpu(195, 0), Gpu(195, 1))
    assert scores.score(Gpu(195, 0), Gpu(195, 0)) == 0 and scores.score(Gpu(1, 1), Gpu(195, 0)) == 0


def brute_force(free: list[Gpu], count: int, scores: PairScores) -> list[Gpu]:
    best, best_score = None, -1
    for combo in itertools.combinations(sorted(free), count):
        total = scores.total(combo)
        if total > best_score:
            best, best_score = list(combo), total
    return best


@st.composite
def scored_nodes(draw):
    n = draw(st.integers(min_value=2, max_value=9))
    gpus = g(*range(n))
    pairs = {}
    for a, b in itertools.combinations(gpus, 2):
        pairs[(a, b)] = draw(st.sampled_from([0, 0, 1, 2, 4, 5, 10, 20, 60]))
    free = draw(st.lists(st.sampled_from(gpus), min_size=1, unique=True))
    count = draw(st.integers(min_value=0, max_value=len(free)))
    return gpus, PairScores(gpus, pairs), free, count


@settings(max_examples=150, deadline=None)
@given(scored_nodes())
def test_exhaustive_search_matches_brute_force(node):
    gpus, scores, free, count = node
    chosen = allocate_best(free, count, scores)
    assert len(chosen) == count and set(chosen) <= set(free)
    if 0 < count < len(free):
        assert chosen == brute_force(free, count, scores)


@settings(max_examples=50, deadline=None)
@given(st.lists(st.integers(min_value=0, max_value=40), min_size=1, unique=True), st.integers(min_value=0, max_value=40))
def test_without_topology_it_is_lowest_first(minors, count):
    free = g(*minors)
    assert allocate_best(free, count, PairScores.none(free)) == sorted(free)[:count]


def test_large_nodes_use_greedy_growth_and_still_find_islands():
    # 24 GPUs in three NVLink islands of 8: C(24, 8) is far past the exhaustive limit.
    gpus = g(*range(24))
    pairs = {(a, b): 60 for a, b in itertools.combinations(gpus, 2) if a.minor // 8 == b.minor // 8}
    scores = PairScores(gpus, pairs)
    free = [gpu for gpu in gpus if gpu.minor not in (0, 9)]
    assert allocate_best(free, 8, scores) == g(*range(16, 24))  # the only whole island left
    assert _topology.math.comb(len(free), 8) > _topology.EXHAUSTIVE_LIMIT


def brute_force_with(free: list[Gpu], count: int, scores: PairScores, include: list[Gpu]) -> list[Gpu]:
    best, best_score = None, -1
    for combo in itertools.combinations(sorted(set(free) | set(include)), count):
        if not set(include) <= set(combo):
            continue
        total = scores.total(combo)
        if total > best_score:
            best, best_score = list(combo), total
    return best


@settings(max_examples=150, deadline=None)
@given(scored_nodes(), st.data())
def test_a_must_include_set_is_the_best_superset_of_it(node, data):
    # The kubelet's must-include devices (R-K8-3): the best set holding them, ties to the lowest.
    gpus, scores, free, count = node
    include = data.draw(st.lists(st.sampled_from(free), unique=True, max_size=count))
    chosen = allocate_best(free, count, scores, include=include)
    assert len(chosen) == count and set(include) <= set(chosen) <= set(free)
    assert chosen == brute_force_with(free, count, scores, include)


def test_a_must_include_gpu_brings_its_best_linked_neighbour_and_counts_below_it_are_refused():
    gpus = g(0, 1, 2, 3)
    scores = PairScores(gpus, {(Gpu(195, 0), Gpu(195, 1)): 5, (Gpu(195, 2), Gpu(195, 3)): 60})
    assert allocate_best(gpus, 2, scores, include=g(3)) == g(2, 3)
    assert allocate_best(gpus, 2, PairScores.none(gpus), include=g(3)) == g(0, 3)  # no facts: lowest others
    try:
        allocate_best(gpus, 1, scores, include=g(1, 2))
    except ValueError as error:
        assert "Cannot choose 1 GPUs that include the 2 GPUs" in str(error)
    else:
        raise AssertionError("a count below the must-include set was accepted")


def test_greedy_growth_with_a_must_include_set_stays_in_its_island():
    gpus = g(*range(24))
    pairs = {(a, b): 60 for a, b in itertools.combinations(gpus, 2) if a.minor // 8 == b.minor // 8}
    scores = PairScores(gpus, pairs)
    assert _topology.math.comb(23, 7) > _topology.EXHAUSTIVE_LIMIT
    assert allocate_best(gpus, 8, scores, include=g(13)) == g(*range(8, 16))
