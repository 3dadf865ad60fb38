"""Every rank in step: what one rank's memory, timing or data does never changes which collectives run.

Ranks with budgets 100x apart train to the same bits as equal budgets; a branch and mixture-of-experts routing that
differ by rank give plain PyTorch's result at every stage; a top-level module only some ranks run is a clear error
within one collective; a rank that does not come is named after `comm_timeout` seconds.
"""

from __future__ import annotations

import itertools
import os
import time

import pytest
import torch

from tests.dist import ONE_RANK_FAULTS, RANKS_DIFFER, ranks_apart

try:
    from tests import branchy, parity, tolerance
    from tests.dist import DistributedTestError, run_distributed
except ImportError:  # tests/ itself on sys.path
    import branchy  # type: ignore[no-redef]
    import parity  # type: ignore[no-redef]
    import tolerance  # type: ignore[no-redef]
    from dist import DistributedTestError, run_distributed  # type: ignore[no-redef]

CHUNK_BYTES = parity.CHUNK * 4


def _placements() -> list[tuple[int, str]]:
    return [(s, o) for s, o in itertools.product((0, 1, 2, 3), ("device", "host", "nvme"))]


def _config(stage: int, offload: str, device_chunks: int, host_chunks: int) -> dict:
    cfg: dict = {
        "zero_stage": stage,
        "offload": {"optimizer": offload, "params": offload if stage == 3 else "device"},
        "memory": {"device_budget": device_chunks * CHUNK_BYTES, "host_budget": host_chunks * CHUNK_BYTES},
    }
    return cfg


# Small budgets: at stage 3 the device holds a few chunks and everything else moves; below stage 3 the device must
# hold the full parameters and (optimizer on the device) everything, so its small budget is what that takes.
SMALL = {3: (6, 16), 2: (30, 16), 1: (30, 16), 0: (60, 16)}


def _run_budgets(rank: int, world: int, nvme_root: str, ratio: int) -> dict:
    torch.set_num_threads(1)
    out = {}
    for stage, offload in _placements():
        device, host = SMALL[stage]
        if offload == "device":
            device = 200  # everything on the device: room for all of it on both ranks, still 100x apart below
        if offload == "host":
            host = 200  # the host holds every optimizer state: the device is the squeezed tier
        big = ratio if rank == 0 else 1
        cfg = _config(stage, offload, device * big, host * big)
        nvme = os.path.join(nvme_root, f"{stage}-{offload}") if offload == "nvme" else None
        out[(stage, offload)] = parity.run_hetero(rank, world, steps=4, rows=4, config=cfg, nvme_dir=nvme)
    return out


@ranks_apart(RANKS_DIFFER)
@pytest.mark.timeout(900)
def test_budgets_100x_apart_train_to_the_same_bits(tmp_path):
    """Rank 0 gets 100x rank 1's device and host budgets: rank 1 evicts, moves and re-reads what rank 0 keeps, and
    the losses and weights are bit for bit those of two ranks with equal budgets (data movement never changes a
    value; only the collective schedule could, and it does not depend on the budgets)."""
    unequal = run_distributed(_run_budgets, 2, str(tmp_path / "u"), 100, timeout=800)
    equal = run_distributed(_run_budgets, 2, str(tmp_path / "e"), 1, timeout=800)
    for key in unequal[0]:
        a, b = unequal[0][key], equal[0][key]
        assert a["losses"] == b["losses"], key
        assert all(torch.equal(a["state"][k], b["state"][k]) for k in a["state"]), key
        assert unequal[1][key]["losses"] == a["losses"], key
    # The small rank really was squeezed where it can be: at stage 3 it moved chunks the big one kept.
    for offload in ("host", "nvme"):
        small, large = unequal[1][(3, offload)]["stats"], unequal[0][(3, offload)]["stats"]
        assert sum(small["moved"].values()) > sum(large["moved"].values()), (offload, small["moved"], large["moved"])


def _run_auto(rank: int, world: int) -> dict:
    torch.set_num_threads(1)
    cfg = {"zero_stage": 3, "offload": {"params": "auto", "optimizer": "auto"}}
    cfg["memory"] = {"device_budget": (8 if rank else 400) * CHUNK_BYTES}
    return parity.run_hetero(rank, world, steps=4, rows=4, config=cfg)


@pytest.mark.timeout(300)
def test_auto_placement_with_different_budgets_matches_the_reference():
    results = run_distributed(_run_auto, 2, timeout=240)
    assert results[0]["losses"] == results[1]["losses"]
    exact_losses, exact = parity.reference(steps=4, rows=4, precision="fp64")
    plain_losses, plain = parity.reference(steps=4, rows=4)
    tolerance.assert_losses(results[0]["losses"], exact_losses, plain_losses, dtype=torch.float32)
    tolerance.assert_weights(results[0]["state"], exact, plain, dtype=torch.float32)


# ---- parameters only some ranks use --------------------------------------------------------------------------------
def _run_branchy(rank: int, world: int, nvme_root: str) -> dict:
    torch.set_num_threads(1)
    out = {}
    for stage in (0, 1, 2, 3):
        cfg = {"zero_stage": stage, "chunk_size": 512}
        out[stage] = branchy.run(rank, world, cfg, steps=4)
    cfg = {"zero_stage": 3, "chunk_size": 512, "offload": {"params": "nvme", "optimizer": "nvme"}}
    os.makedirs(os.path.join(nvme_root, str(rank)), exist_ok=True)
    cfg["memory"] = {"nvme_dir": os.path.join(nvme_root, str(rank)), "device_budget": 6 * 512 * 4}
    out["3-nvme"] = branchy.run(rank, world, cfg, steps=4)
    return out


@ranks_apart(RANKS_DIFFER)
@pytest.mark.timeout(600)
def test_branches_and_experts_that_differ_by_rank_match_plain_pytorch(tmp_path):
    """Rank 0 takes branch a and experts 0-1, rank 1 branch b and experts 1-2, nobody expert 3: at every stage
    the result is plain PyTorch's mean over the ranks' losses (unused parameters count as zero gradients)."""
    results = run_distributed(_run_branchy, 2, str(tmp_path), timeout=550)
    exact_losses, exact = branchy.reference(4, 2, torch.float64)
    plain_losses, plain = branchy.reference(4, 2)
    init = branchy.build().state_dict()
    for key, r in results[0].items():
        assert r["losses"] == results[1][key]["losses"], key
        tolerance.assert_losses(r["losses"], exact_losses, plain_losses, dtype=torch.float32)
        tolerance.assert_weights(r["state"], exact, plain, dtype=torch.float32)
        # Expert 3 got no token anywhere: PyTorch skips a parameter without a gradient, and so did hetero.
        name = "blocks.0.experts.3.0.weight"
        assert torch.equal(r["state"][name], init[name]), key
        # Rank 0's branch and rank 1's both trained.
        assert not torch.equal(r["state"]["blocks.0.a.weight"], init["blocks.0.a.weight"]), key
        assert not torch.equal(r["state"]["blocks.0.b.weight"], init["blocks.0.b.weight"]), key


@ranks_apart(RANKS_DIFFER)
@pytest.mark.timeout(120)
def test_a_top_level_module_only_some_ranks_run_is_a_clear_error_at_stage3():
    results = run_distributed(branchy.run_skipped_module, 2, timeout=100)
    for r in results:
        seconds, _, message = r.partition("|")
        assert message, r
        assert float(seconds) < 10
        assert "'extra'" in message and "move it into a block" in message, message


# ---- ranks that do not come -----------------------------------------------------------------------------------------
def _run_one_rank_stops(rank: int, world: int, mode: str, done: str = "") -> str:
    """Rank 1 dies, or hangs (never reaches the step) for 30 s or until rank 0 has its error and touches `done`."""
    import hetero

    torch.set_num_threads(1)
    model = parity.build()
    cfg = {"zero_stage": 3, "chunk_size": parity.CHUNK, "comm_timeout": 4}
    engine = hetero.initialize(model, parity.make_optimizer(model), cfg)
    x, y = parity.batches(1, 2)[0]
    if rank == 1:
        if mode == "dies":
            os._exit(3)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not (done and os.path.exists(done)):
            time.sleep(0.2)
        return "slept"
    started = time.monotonic()
    try:
        engine.backward(engine(x[:2], labels=y[:2]).loss)
    except hetero.errors.RankTimeoutError as err:
        report = f"{time.monotonic() - started:.1f}|{err}"
    except RuntimeError as err:
        report = f"{time.monotonic() - started:.1f}|{type(err).__name__}: {err}"
    else:
        report = "no error"
    closing = time.monotonic()
    engine.close()  # after the error: returns, and frees nothing a queued collective may still write into
    report += f"|closed in {time.monotonic() - closing:.1f} s"
    if done:
        open(done, "w").close()
    return report


@ranks_apart(ONE_RANK_FAULTS)
@pytest.mark.timeout(180)
def test_a_hung_rank_is_named_after_comm_timeout(tmp_path):
    # The time limit leaves room for a loaded machine's start-up (spawn, import torch, initialize): what is measured
    # is the time from the step to the error, inside rank 0.
    try:
        report = run_distributed(_run_one_rank_stops, 2, "hangs", str(tmp_path / "done"), timeout=90)[0]
    except DistributedTestError as err:  # rank 1 may fail on waking: rank 0's report is what counts
        report = err.results.get(0)
    except TimeoutError as err:
        report = err.results.get(0)
    assert report is not None, "rank 0 did not report"
    seconds, _, message = report.partition("|")
    assert 3.5 < float(seconds) < 20, report
    assert "timed out after 4 s" in message and "Global rank(s) 1 did not arrive" in message, message
    assert "chunk 0" in message, message  # the operation and the data it was about
    message, _, closed = message.rpartition("|closed in ")
    assert float(closed.split()[0]) < 10, report  # the engine closes after the error, without waiting on rank 1


@ranks_apart(ONE_RANK_FAULTS)
@pytest.mark.timeout(120)
def test_a_dead_rank_is_an_error_not_a_hang():
    with pytest.raises(DistributedTestError) as info:
        run_distributed(_run_one_rank_stops, 2, "dies", timeout=60, report_grace=30)
    report = info.value.results.get(0)
    assert report is not None and report != "no error", info.value
    seconds, _, message = report.partition("|")
    assert float(seconds) < 20 and "1" in message, report
    assert float(message.rpartition("|closed in ")[2].split()[0]) < 10, report
