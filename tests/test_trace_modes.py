"""One access trace per kind of step: training and evaluation alternate, and each replays its own recording
([Note: one trace per kind of step] in hetero/memory/policy.py)."""

import pytest
import torch

import hetero
from hetero.memory import TensorState, Tier

try:
    from tests import parity
except ImportError:  # tests/ itself on sys.path
    import parity  # type: ignore[no-redef]

NUMEL = 1024
LAYERS = 8


def _layers(m):
    """LAYERS parameter chunks, on the host: a model whose device holds only a few of them at once."""
    chunks = []
    for i in range(LAYERS):
        c = m.new_chunk(dtype=torch.float32, capacity=NUMEL)
        s = c.add_tensor(f"layer{i}", (NUMEL,))
        m.access(c, Tier.HOST)
        c.set_state(s, TensorState.HOLD)
        chunks.append(c)
    return chunks


def _step(m, chunks, kind):
    """A training step (forward, backward: the layers in reverse) or an evaluation (forward only); returns its demand
    loads (accesses that found their chunk neither on the device nor on its way). Every move ends before the next
    call (`synchronize`), so what prefetch starts, and when, depends on the trace alone, not on thread timing."""
    before = m.counters["prefetch_misses"]
    m.step_begin(kind)  # its prefetch starts
    m.synchronize()
    order = chunks + chunks[::-1] if kind == "train" else chunks
    for c in order:
        m.access(c, Tier.DEVICE, write=False)
        m.synchronize()
    m.step_end()
    return m.counters["prefetch_misses"] - before


def test_a_training_step_after_an_evaluation_prefetches_as_one_after_a_training_step(make_manager):
    """Under a device budget of three layers, a training step replaying its trace loads no chunk on demand: prefetch
    brought each one ahead of use. An evaluation between two training steps records its own trace (forward only) and
    leaves the training one alone: the training step after it is as good as one after a training step, and so is an
    evaluation after a training step. (With one trace, the evaluation became it: the training step after each
    evaluation replayed a forward only, prefetched nothing for its backward and loaded 6 of its 16 accesses on demand,
    then was recorded afresh.)"""
    m = make_manager(device_budget=3 * NUMEL * 4, prefetch_depth=2)
    chunks = _layers(m)
    _step(m, chunks, "train")  # recorded
    after_train = _step(m, chunks, "train")
    assert after_train == 0
    _step(m, chunks, "eval")  # recorded: the first of its kind
    _step(m, chunks, "train")  # after a recording, which left the device as LRU did and prefetched nothing ahead
    loads = [(kind, _step(m, chunks, kind)) for kind in ("eval", "train", "train", "eval", "eval", "train")]
    assert loads == [(kind, after_train) for kind, _ in loads]
    assert m.trace.mismatches == 0
    assert m.counters["prefetches"] > 0


def test_a_partial_step_forgets_only_the_trace_of_its_kind(make_manager):
    """`step_end(keep=False)` (a backward that raised) drops the training trace, not the evaluation's: the next
    evaluation still replays (it prefetches), the next training step is recorded afresh."""
    m = make_manager(device_budget=3 * NUMEL * 4, prefetch_depth=2)
    chunks = _layers(m)
    for kind in ("train", "eval", "train", "eval"):
        _step(m, chunks, kind)
    m.step_begin("train")
    m.synchronize()
    for c in chunks[:3]:
        m.access(c)
        m.synchronize()
    m.step_end(keep=False)
    assert _step(m, chunks, "eval") == 0
    m.step_begin("train")
    assert not m.trace.replaying  # nothing of its kind to replay
    m.step_end(keep=False)


def _engine(tmp_path, **config):
    model = parity.build()
    nb = parity.CHUNK * 4
    cfg = {
        "zero_stage": 3,
        "chunk_size": parity.CHUNK,
        "offload": {"params": "host", "optimizer": "host"},
        "memory": {"device_budget": 4 * nb},
        **config,
    }
    return hetero.initialize(model, parity.make_optimizer(model), cfg)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("microbatches", [1, 2], ids=["engine-calls", "train-batch"])
def test_engine_training_and_evaluation_each_replay_their_own_trace(tmp_path, microbatches):
    """Through the engine, at stage 3 with a device of four chunks: an evaluation every other step, written as users
    write it (model.eval() and torch.no_grad(), HF's Trainer) or as `eval_batch`, breaks no replay, of the training
    steps or of its own; before, each evaluation ended the training trace early and the training step after it broke
    off its replay at its backward (two mismatches per evaluation). With `parallel.microbatches` 2 the training batch
    and `eval_batch` hold one step open around their micro-batches (`Engine.trace_step`)."""
    engine = _engine(tmp_path, parallel={"microbatches": microbatches})
    m = engine.manager
    data = parity.batches(3, 4)

    def train(x, y):
        engine.train()
        if microbatches > 1:
            engine.train_batch(x, y)
        else:
            engine.backward(engine(x, labels=y).loss)
            engine.step()

    def evaluate(x, y, i):
        engine.eval()
        if i % 2:
            engine.eval_batch(x, y)
        else:
            with torch.no_grad():
                engine(x, labels=y)

    train(*data[0])
    evaluate(*data[0], 0)
    replayed = m.counters["prefetches"]
    for i, (x, y) in enumerate(data[1:]):
        train(x, y)
        evaluate(x, y, i + 1)
    engine.close()
    assert m.trace.mismatches == 0
    assert m.counters["prefetches"] > replayed  # the replays prefetched


@pytest.mark.timeout(120)
def test_activation_offload_breaks_no_replay(tmp_path):
    """[Note: chunks of one step]: activation offload's host chunks are new every step; their accesses are left out of
    the trace, so training steps replay and prefetch as without offload. Before, the first offloaded input broke every
    step's replay (a mismatch each step, no prefetch, every chunk loaded on demand)."""
    engine = _engine(tmp_path, activation_checkpointing=True, activation_offload=True)
    m = engine.manager
    offloaded = []
    for i, (x, y) in enumerate(parity.batches(3, 4)):
        if i == 1:
            recorded = m.counters["prefetches"]
        engine.backward(engine(x, labels=y).loss)
        engine.step()
        offloaded.append(engine.activations.offloaded_bytes)
    engine.close()
    assert offloaded[-1] > offloaded[0] > 0  # inputs were offloaded every step
    assert m.trace.mismatches == 0
    assert m.counters["prefetches"] > recorded
