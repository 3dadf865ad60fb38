"""Tests of hetero.memory.chunk_size: greedy packing and the chunk capacity search."""

from __future__ import annotations

import time

import numpy as np
import pytest

from hetero.memory.chunk_size import ChunkPlan, pack, plan_chunks, search_chunk_size


def _check_packing(sizes: list[int], cap: int, chunks: list[list[int]]) -> None:
    """Every tensor placed exactly once, in order, and no regular chunk over capacity."""
    flat = [i for c in chunks for i in c]
    assert flat == list(range(len(sizes)))
    for c in chunks:
        assert c == list(range(c[0], c[-1] + 1)), "a chunk holds a contiguous run of tensors"
        if len(c) == 1 and sizes[c[0]] > cap:
            continue  # oversize: its own chunk
        assert all(sizes[i] <= cap for i in c)
        assert sum(sizes[i] for i in c) <= cap


def _brute_force(sizes: list[int], lo: int, hi: int) -> ChunkPlan:
    """Least-waste plan over every capacity in [lo, hi], smallest on ties (search with align = step = 1)."""
    best = None
    for cap in range(lo, hi + 1):
        plan = plan_chunks(sizes, cap)
        if best is None or plan.allocated_numel < best.allocated_numel:
            best = plan
    assert best is not None
    return best


class TestPack:
    def test_hand_example(self) -> None:
        assert pack([3, 4, 2, 5, 1], 6) == [[0], [1, 2], [3, 4]]

    def test_fills_in_order_without_looking_back(self) -> None:
        # 4 does not fit after 5, so a new chunk opens; the 1s would fit the first chunk's gap, but only the
        # current chunk is ever filled.
        assert pack([5, 4, 1, 1], 6) == [[0], [1, 2, 3]]
        assert pack([2, 2, 2, 2, 2], 4) == [[0, 1], [2, 3], [4]]

    def test_exact_fit(self) -> None:
        assert pack([3, 3, 3, 3], 6) == [[0, 1], [2, 3]]
        assert pack([6, 6], 6) == [[0], [1]]

    def test_oversize_gets_own_chunk_and_closes_current(self) -> None:
        sizes = [2, 10, 2, 2, 7, 1]
        chunks = pack(sizes, 6)
        assert chunks == [[0], [1], [2, 3], [4], [5]]
        plan = plan_chunks(sizes, 6)
        assert plan == ChunkPlan(chunk_numel=6, num_chunks=3, oversize=2, total_numel=24, allocated_numel=35)
        assert plan.waste_fraction == pytest.approx(1 - 24 / 35)
        assert plan.waste_numel == 11

    def test_all_oversize_wastes_nothing(self) -> None:
        plan = plan_chunks([10, 20, 30], 5)
        assert plan.num_chunks == 0 and plan.oversize == 3
        assert plan.allocated_numel == plan.total_numel == 60
        assert plan.waste_fraction == 0.0

    def test_accepts_numpy_ints(self) -> None:
        assert pack(np.array([1, 2, 3], dtype=np.int64), np.int64(3)) == [[0, 1], [2]]

    @pytest.mark.parametrize("seed", range(20))
    def test_invariants_random(self, seed: int) -> None:
        rng = np.random.default_rng(seed)
        sizes = rng.integers(1, 200, size=int(rng.integers(1, 300))).tolist()
        for cap in (1, 7, 64, 150, 199, 200, 1000):
            chunks = pack(sizes, cap)
            _check_packing(sizes, cap, chunks)
            plan = plan_chunks(sizes, cap)
            assert plan.num_chunks + plan.oversize == len(chunks)
            assert plan.oversize == sum(s > cap for s in sizes)
            assert plan.total_numel == sum(sizes)
            assert plan.allocated_numel >= plan.total_numel
            assert 0.0 <= plan.waste_fraction < 1.0


class TestSearch:
    def test_known_answer(self) -> None:
        # Tensors of 3, 5, 3, 5: capacity 8 packs [3,5][3,5] with no waste; 5..7 waste, 16 too, and capacities
        # above 8 up to 15 waste the tail of their chunk. So 8 wins; 16 ties it, and the smaller is kept.
        plan = search_chunk_size([3, 5, 3, 5], min_numel=1, max_numel=16, step_numel=1, align_numel=1)
        assert plan.chunk_numel == 8
        assert plan.num_chunks == 2 and plan.oversize == 0 and plan.waste_fraction == 0.0

    def test_tie_goes_to_smaller(self) -> None:
        # 4, 8, 12 all pack [4]*6 with no waste.
        plan = search_chunk_size([4] * 6, min_numel=4, max_numel=12, step_numel=4, align_numel=4)
        assert plan.chunk_numel == 4

    def test_starts_at_largest_tensor(self) -> None:
        # Nothing may be oversize by default, so no capacity below 100 is tried even though min_numel is 1.
        plan = search_chunk_size([100, 1, 1], min_numel=1, max_numel=1000, step_numel=1, align_numel=1)
        assert plan.oversize == 0
        assert plan.chunk_numel == 102

    def test_alignment(self) -> None:
        plan = search_chunk_size([1000, 30, 30], min_numel=1, max_numel=4096, step_numel=64, align_numel=64)
        assert plan.chunk_numel % 64 == 0
        assert plan.chunk_numel == 1088  # 1060 rounded up to a multiple of 64
        # A step that is not a multiple of the alignment still yields aligned capacities.
        plan = search_chunk_size([1000, 30, 30], min_numel=1, max_numel=4096, step_numel=100, align_numel=64)
        assert plan.chunk_numel % 64 == 0

    def test_largest_beyond_max_becomes_oversize(self) -> None:
        plan = search_chunk_size([500, 10, 20, 10], min_numel=1, max_numel=64, step_numel=1, align_numel=1)
        assert plan.oversize == 1 and plan.num_chunks == 1
        assert plan.chunk_numel == 40
        assert plan.allocated_numel == 540

    def test_oversize_fraction_allows_smaller_chunks(self) -> None:
        sizes = [90] + [10] * 91  # the big tensor holds 90 / 1000 of the elements
        strict = search_chunk_size(sizes, min_numel=1, max_numel=200, step_numel=1, align_numel=1)
        assert strict.oversize == 0 and strict.chunk_numel >= 90
        loose = search_chunk_size(
            sizes, min_numel=1, max_numel=200, step_numel=1, align_numel=1, max_oversize_fraction=0.1
        )
        assert loose.oversize == 1 and loose.chunk_numel == 10 and loose.waste_fraction == 0.0
        # Just under the big tensor's share: it must fit a regular chunk again.
        tight = search_chunk_size(
            sizes, min_numel=1, max_numel=200, step_numel=1, align_numel=1, max_oversize_fraction=0.089
        )
        assert tight.oversize == 0

    @pytest.mark.parametrize("seed", range(15))
    def test_matches_brute_force(self, seed: int) -> None:
        rng = np.random.default_rng(100 + seed)
        sizes = rng.integers(1, 60, size=int(rng.integers(1, 80))).tolist()
        if seed % 3 == 0:
            sizes[int(rng.integers(len(sizes)))] = 500  # beyond max_numel: forced oversize
        lo, hi = int(rng.integers(1, 40)), int(rng.integers(60, 200))
        plan = search_chunk_size(sizes, min_numel=lo, max_numel=hi, step_numel=1, align_numel=1)
        fitting = [s for s in sizes if s <= hi]
        expect = _brute_force(sizes, max([lo, *fitting]), hi)
        assert plan == expect
        _check_packing(sizes, plan.chunk_numel, pack(sizes, plan.chunk_numel))

    def test_defaults_are_fast_on_10k_tensors(self) -> None:
        rng = np.random.default_rng(7)
        # A model-like mix: small norms and biases, larger matrices; the smallest capacity makes ~7k chunks.
        sizes = rng.choice([4096, 11008, 600_000, 1 << 20, 4096 * 4096], size=10_000).tolist()
        t0 = time.perf_counter()
        plan = search_chunk_size(sizes)
        elapsed = time.perf_counter() - t0
        assert elapsed < 5.0, f"search took {elapsed:.2f} s"
        assert plan.chunk_numel % (1 << 10) == 0
        assert (1 << 20) <= plan.chunk_numel <= (64 << 20)
        assert plan.oversize == 0
        # The vectorised count agrees with the reference packing at the chosen capacity.
        assert plan.num_chunks == len(pack(sizes, plan.chunk_numel))


class TestValidation:
    def test_empty(self) -> None:
        with pytest.raises(ValueError, match="empty"):
            search_chunk_size([])
        with pytest.raises(ValueError, match="empty"):
            pack([], 10)
        with pytest.raises(ValueError, match="empty"):
            plan_chunks([], 10)

    @pytest.mark.parametrize("bad", [0, -5])
    def test_non_positive_numel(self, bad: int) -> None:
        with pytest.raises(ValueError, match=r"numels\[1\] = " + str(bad)):
            search_chunk_size([4, bad, 4])
        with pytest.raises(ValueError, match="at least one element"):
            pack([4, bad], 10)

    def test_non_integer_numel(self) -> None:
        with pytest.raises(ValueError, match="not an integer"):
            pack([4, 2.5], 10)

    def test_min_above_max(self) -> None:
        with pytest.raises(ValueError, match="min_numel = 100 is larger than max_numel = 50"):
            search_chunk_size([1, 2], min_numel=100, max_numel=50)

    def test_no_aligned_capacity(self) -> None:
        with pytest.raises(ValueError, match="no multiple of align_numel"):
            search_chunk_size([1, 2], min_numel=10, max_numel=20, align_numel=64)

    @pytest.mark.parametrize("name", ["min_numel", "max_numel", "step_numel", "align_numel"])
    def test_non_positive_parameters(self, name: str) -> None:
        with pytest.raises(ValueError, match=f"{name} = 0 must be positive"):
            search_chunk_size([1, 2], **{name: 0})

    def test_bad_capacity_and_fraction(self) -> None:
        with pytest.raises(ValueError, match="chunk_numel = 0 must be positive"):
            pack([1], 0)
        with pytest.raises(ValueError, match="max_oversize_fraction"):
            search_chunk_size([1], max_oversize_fraction=1.5)
