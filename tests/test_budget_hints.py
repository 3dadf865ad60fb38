"""The out-of-memory error's budget is one that runs, and budgets that force tiny automatic chunks say so.

The figure is checked the only way that makes it true: used as the budget, a training step succeeds. The budgets
tried first are those that failed with a figure too low before (see [Note: the budget that would have been enough]):
one so small that the first request alone exceeds it, and one just above that, where a later moment needs more.
"""

from __future__ import annotations

import logging
import re

import pytest

import hetero
from hetero.config import parse_size
from hetero.errors import TierOutOfMemoryError
from hetero.memory.chunk_budgets import SMALL_NUMEL, budget_costs, small_chunks
from hetero.memory.chunk_size import budget_cap

try:
    from tests import parity
except ImportError:  # tests/ itself on sys.path
    import parity  # type: ignore[no-redef]

# ZeRO-3 with parameters kept on the device between uses and optimizer states on the host: examples/train_gpt.py's
# defaults, NVMe left out (the device budget is the one under test).
BASE = {"zero_stage": 3, "precision": "fp32", "offload": {"params": "device", "optimizer": "host"}}


def _step(budget: int, chunk_size: int | str, **overrides: object) -> hetero.Engine:
    """One training step of the tiny GPT under `budget` bytes of device memory; the engine, closed."""
    model = parity.build()
    config = {**BASE, "chunk_size": chunk_size, "memory": {"device_budget": budget, "host_budget": 64 << 20}}
    config.update(overrides)
    engine = hetero.initialize(model, parity.make_optimizer(model), config)
    try:
        x, y = parity.batches(1, rows=2)[0]
        engine.backward(engine(x, labels=y).loss)
        engine.step()
    finally:
        engine.close()
    return engine


def _figure(error: TierOutOfMemoryError) -> int:
    found = re.search(r"A budget of ([0-9.]+) (\w+) would have been enough", str(error))
    assert found, str(error)
    raise_to = re.search(r"raise memory.device_budget to at least ([0-9.]+) (\w+)", str(error))
    assert raise_to and raise_to.groups() == found.groups(), str(error)  # the advice names the same figure
    return parse_size(found.group(1) + found.group(2), key="enough")


@pytest.mark.parametrize("chunk_size", [1024, "auto"])
@pytest.mark.parametrize("first", [1 << 10, 4 << 10])
def test_the_figure_of_an_out_of_memory_error_runs_as_the_budget(chunk_size, first):
    """1 KiB: the first request (a 4 KiB chunk) alone is too much, and "it and what could not move" named 4 KiB, at
    which a layer's weight tile and the chunk of the norm before it (computed on together) needed 8 KiB. With "auto"
    the chunks are sized by the budget too: the figure must hold at the size it gives."""
    with pytest.raises(TierOutOfMemoryError) as info:
        _step(first, chunk_size)
    assert info.value.tier == "device", str(info.value)
    enough = _figure(info.value)
    assert enough > first
    _step(enough, chunk_size)  # raises if the figure was not enough


def _sizing(*, device_budget: int) -> dict[str, object]:
    return dict(
        device_budget=device_budget,
        host_budget=None,
        stage=3,
        param_bytes=4,
        n_states=2,
        params_tier="device",
        optim_tier="host",
        prefetch_depth=2,
        world=1,
    )


@pytest.mark.parametrize("stage", [1, 2])
def test_the_figure_counts_the_parameters_stages_0_to_2_keep_on_the_device(stage):
    """Stages 0-2 compute on every parameter chunk from the forward to the backward: a failure in the middle of the
    forward (12 KiB: the embeddings held, a layer's weight asked) names a budget for all of them, and the gradient
    buffers of the backward beside them, not one chunk more than the moment's."""
    with pytest.raises(TierOutOfMemoryError) as info:
        _step(12 << 10, 1024, zero_stage=stage)
    assert "(being computed on)" in str(info.value), str(info.value)  # a failure mid-forward, not the first request
    _step(_figure(info.value), 1024, zero_stage=stage)


@pytest.mark.parametrize(("stage", "chunk_size"), [(0, 1024), (0, "auto"), (1, 1024), (1, "auto"), (2, 1024)])
def test_the_figure_at_the_first_request_counts_the_parameters_the_step_keeps(stage, chunk_size):
    """1 KiB: the step's first request (the first parameter chunk) fails with nothing computed on yet. The figure
    named 8 KiB there (that chunk twice), where stages 0-2 keep every parameter chunk on the device through the
    step: it must run as the budget, as the mid-forward one above does. (Stage 2 under "auto", whose automatic chunk
    size follows the device budget: the next test.)"""
    with pytest.raises(TierOutOfMemoryError) as info:
        _step(1 << 10, chunk_size, zero_stage=stage)
    assert "being computed on" not in str(info.value), str(info.value)  # the first request
    _step(_figure(info.value), chunk_size, zero_stage=stage)


@pytest.mark.parametrize("first", [1 << 10, 4 << 10, 12 << 10])
def test_under_automatic_chunks_the_figure_runs_with_the_chunk_size_it_names(first):
    """Stage 2, chunk_size "auto": the chunks grow with the budget, so a figure counted at this budget's chunks fell
    short at the next one's (120 KiB named, failing; then 160 KiB). The message names the size "auto" chose, and the
    figure with that size set runs at the first try ([Note: a figure at the chunk size it was counted at])."""
    with pytest.raises(TierOutOfMemoryError) as info:
        _step(first, "auto", zero_stage=2)
    chosen = re.search(r"set chunk_size: (\d+) with the larger budget", str(info.value))
    assert chosen, str(info.value)
    _step(_figure(info.value), int(chosen.group(1)), zero_stage=2)


def test_a_chunk_size_the_user_set_is_not_named_again():
    with pytest.raises(TierOutOfMemoryError) as info:
        _step(1 << 10, 1024, zero_stage=2)
    assert "set chunk_size" not in str(info.value), str(info.value)


def _warned(budget: int | None, chunk_size: int | str, caplog: pytest.LogCaptureFixture) -> list[str]:
    """The small-chunk warnings `hetero.initialize` logs (`layout.warn_small_chunks`) for the tiny GPT under `budget`
    bytes of device memory (None: the default budgets)."""
    model = parity.build()
    memory = {"host_budget": 64 << 20} if budget is None else {"device_budget": budget, "host_budget": 64 << 20}
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="hetero"):
        engine = hetero.initialize(
            model, parity.make_optimizer(model), {**BASE, "chunk_size": chunk_size, "memory": memory}
        )
    engine.close()
    return [r.getMessage() for r in caplog.records if 'chunk_size "auto" chose chunks of' in r.getMessage()]


def test_budgets_that_force_tiny_automatic_chunks_are_named_with_the_budget_that_lifts_them(caplog):
    """The tiny GPT (~26K elements) with no budget pressure gets chunks of at least 3.3K elements (an eighth of the
    model); 64 KiB of device budget forces the 1024-element floor: the warning names the size, the budget that forced
    it and the one that gives the usual size. The default budgets warn of nothing, nor does an explicit chunk_size."""
    (message,) = _warned(64 << 10, "auto", caplog)
    assert "chunks of 1024 elements (4.00 KiB)" in message and "memory.device_budget = 64.00 KiB" in message, message
    assert "Raise memory.device_budget to " in message and "or set chunk_size yourself" in message, message
    assert _warned(None, "auto", caplog) == []
    assert _warned(64 << 10, 1024, caplog) == []


def test_the_budget_the_warning_names_gives_chunks_of_the_usual_size():
    """What the warning tells the user to set gives a cap no smaller than the size it promises."""
    sizing = _sizing(device_budget=8 << 10)
    message = small_chunks(1024, natural_numel=1 << 20, itemsize=4, costs=budget_costs(**sizing))
    assert message is not None
    found = re.search(r"Raise memory.device_budget to ([0-9.]+) (\w+) for chunks of (\d+) elements", message)
    assert found, message
    lifted = parse_size(found.group(1) + found.group(2), key="budget")
    promised = int(found.group(3))
    assert promised == SMALL_NUMEL
    # The figure is rounded up to what format_size prints exactly, so the printed budget itself gives the size.
    assert budget_cap(**{**sizing, "device_budget": lifted}) >= promised
    assert small_chunks(SMALL_NUMEL, natural_numel=1 << 20, itemsize=4, costs=budget_costs(**sizing)) is None
    # A model whose own packing is small: the budget did not force anything.
    assert small_chunks(1024, natural_numel=1024, itemsize=4, costs=budget_costs(**sizing)) is None
