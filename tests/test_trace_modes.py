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
    # Its own trace replays, with no demand load: the partial step took back its unused prefetches, so the device has
    # room for the evaluation's first chunks whenever they landed ([Note: a partial step takes its prefetches back] in
    # hetero/memory/prefetch.py; before, 1-5% of runs loaded the first chunk on demand).
    mismatches, prefetches = m.trace.mismatches, m.counters["prefetches"]
    assert _step(m, chunks, "eval") == 0
    assert m.trace.mismatches == mismatches and m.counters["prefetches"] > prefetches  # it replayed, prefetching
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


def _update_chunks(engine):
    """The ids of the chunks only the update reads (optimizer states and masters)."""
    return {zc.optim.id for zc in engine.chunks if zc.optim is not None}


def _training_trace(m):
    trace = m.trace.trace if m.trace.kind == "train" else m.trace._shelved["train"][0]
    return trace or []


@pytest.mark.timeout(120)
@pytest.mark.parametrize("at_once", [True, False], ids=["copies-at-once", "copies-held"])
def test_a_pipelined_batch_records_its_update(tmp_path, cpu_device, copies, at_once):
    """`train_batch` with `parallel.microbatches` 2 holds one trace step around its micro-batches; with
    `grad_accumulation_steps` 1 the update belongs to it, as after `engine.backward`. Before, the step ended before
    `train_batch` called `engine.step()`: the trace never held the update, nothing prefetched its optimizer states and
    gradients, and each of them was loaded on demand at every step (with the optimizer on a device of ten chunks, 15
    demand loads a step; none with the update traced, 2 with every copy landing only when waited for). The copies run
    on the driving thread (`copies`), at once or held until waited for, so whether a prefetch found its room made does
    not depend on thread timing. (With worker threads it did: one CI run counted [1, 4, 3] demand loads.)"""
    engine = _engine(
        tmp_path,
        offload={"params": "host", "optimizer": "device"},
        memory={"device_budget": 10 * parity.CHUNK * 4},
        parallel={"microbatches": 2},
    )
    copies.at_once = at_once
    m = engine.manager
    update = _update_chunks(engine)
    loads = []
    original = m.access

    def access(chunk, tier=Tier.DEVICE, **kwargs):
        before = m.counters["prefetch_misses"]
        out = original(chunk, tier, **kwargs)
        if m.counters["prefetch_misses"] > before and chunk.kind in ("optim", "grad"):
            loads[-1] += 1
        return out

    m.access = access
    for x, y in parity.batches(4, 4):
        loads.append(0)
        engine.train_batch(x, y)
    traced = {cid for cid, _ in _training_trace(m)}
    engine.close()
    assert m.trace.mismatches == 0
    if at_once:
        assert loads[1:] == [0, 0, 0], loads
    else:  # an eviction lands only when waited for: the first update chunks of a size no eviction in flight has
        # cannot chain behind one ([Note: reads chained behind write-backs] in hetero/memory/manager.py)
        assert max(loads[1:]) < len(update), loads
    assert update <= traced  # the update's accesses are the step's


@pytest.mark.timeout(120)
@pytest.mark.parametrize("how", ["no-grad", "eval-batch"])
def test_an_evaluation_between_backward_and_step_leaves_the_training_step_whole(tmp_path, how):
    """[Note: a step within a step]: with `grad_accumulation_steps` 1 the training step runs on through its update;
    an evaluation between the backward and `step()` (a metric on the batch, as a loop writes it or as `eval_batch`)
    is a step of its own, replaying the evaluation trace, and the training step resumes for its update. Before, the
    evaluation ended the training step there: the update went unrecorded, and each training step after one with an
    evaluation broke off its replay (here 5 mismatches in 6 steps)."""
    engine = _engine(tmp_path)
    m = engine.manager
    for i, (x, y) in enumerate(parity.batches(6, 4)):
        engine.backward(engine(x, labels=y).loss)
        if i % 2:
            if how == "eval-batch":
                engine.eval_batch(x, y)
            else:
                with torch.no_grad():
                    engine(x, labels=y)
        engine.step()
    traced = {cid for cid, _ in _training_trace(m)}
    engine.close()
    assert m.trace.mismatches == 0
    assert _update_chunks(engine) <= traced


class _Tiled(torch.nn.Module):
    """An embedding and a head each larger than a chunk: tiled ([Note: tiles] in hetero/zero/tiling.py)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(96, 16)
        self.head = torch.nn.Linear(16, 96, bias=False)

    def forward(self, ids):
        return self.head(torch.tanh(self.embed(ids)))


@pytest.mark.timeout(120)
def test_gathered_tiled_weights_in_an_open_step_break_no_replay():
    """`gathered_parameters` on a tiled weight assembles it whole in a chunk made for the block and freed after it:
    a new chunk at every use ([Note: chunks of one step]). Inside an open step (here between backward and the update,
    a loop reading a weight's norm every step) its access is left out of the trace. Before, it broke every step's
    replay (a mismatch a step)."""
    torch.manual_seed(0)
    model = _Tiled()
    engine = hetero.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), {"zero_stage": 3, "chunk_size": 256})
    assert "head.weight" in engine.memory_stats()["tiled"]
    m = engine.manager
    g = torch.Generator().manual_seed(1)
    for _ in range(4):
        ids = torch.randint(0, 96, (3, 7), generator=g)
        engine.backward(engine(ids).square().mean())
        with engine.gathered_parameters([model.head.weight]):
            assert torch.isfinite(model.head.weight.norm())
        engine.step()
    engine.close()
    assert m.trace.mismatches == 0


@pytest.mark.timeout(120)
def test_several_forwards_before_one_backward_are_one_step(tmp_path, cpu_device):  # copies synchronous
    """A loss over two forwards of the model (a contrastive pair, a GAN's discriminator on real and fake) is one
    training step, both forwards and the backward, and replays as such. (Decided against: a second forward with
    autograd and no backward between beginning a step of its own, for an evaluation that leaves autograd on. At stage
    3 such a forward finds the first one's chunks still gathered for the backward that may come, so its accesses
    differ from a first forward's anyway: as steps of their own they broke every replay, where one step breaks two.)
    A device of five chunks: the backward through both forwards holds more at once than one forward's."""
    engine = _engine(tmp_path, memory={"device_budget": 5 * parity.CHUNK * 4})
    m = engine.manager
    for i, (x, y) in enumerate(parity.batches(4, 4)):
        if i == 1:
            recorded = m.counters["prefetches"]
        loss = engine(x, labels=y).loss + engine(y, labels=x).loss
        engine.backward(loss)
        engine.step()
    engine.close()
    assert m.trace.mismatches == 0
    assert m.counters["prefetches"] > recorded
