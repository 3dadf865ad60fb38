"""The CPU stand-in for an accelerator (`HETERO_STANDIN=1`, [Note: the CPU stand-in]): its rules fail where a GPU
would, and every ZeRO path trains under them, bit for bit as without them, with torch's own collective checks on
(TORCH_DISTRIBUTED_DEBUG=DETAIL)."""

from __future__ import annotations

import os

import pytest
import torch

import hetero
import hetero.device
from hetero import standin
from hetero.device import StandinDevice
from hetero.errors import CommError
from hetero.memory import ChunkManager, Tier
from hetero.memory.pool import BufferPool
from hetero.memory.tier import TierLedger
from tests.dist import NEEDS_DEGREES, ONLY_SEVERAL, ranks_apart

try:
    from tests import parity, pipe_parity
    from tests.dist import run_distributed
except ImportError:  # tests/ itself on sys.path
    import parity  # type: ignore[no-redef]
    import pipe_parity  # type: ignore[no-redef]
    from dist import run_distributed  # type: ignore[no-redef]


# ---- the rules, one by one ------------------------------------------------------------------------------------------
def test_a_copy_touching_device_memory_needs_a_fresh_compute_marker():
    dev = StandinDevice()
    d, h = dev.empty((8,), torch.float32), dev.to_host(torch.arange(8.0), copy=True)
    with pytest.raises(standin.StandinOrderingError, match="no compute marker"):
        dev.copy(d, h)
    old = dev.compute_marker()
    dev.copy(d, h, after=old)
    assert torch.equal(d, h)
    pool = BufferPool(dev.empty_bytes, TierLedger(Tier.DEVICE, 1 << 20), on_release=dev.released)
    buf = pool.acquire(32).view(torch.float32)
    buf.zero_()
    pool.release(buf)  # compute may still read it until a marker recorded after this
    assert torch.isnan(buf).all()  # and it is poisoned
    reused = pool.acquire(32).view(torch.float32)
    with pytest.raises(standin.StandinOrderingError, match="handed back to a pool"):
        dev.copy(reused, h, after=old)
    dev.copy(reused, h, after=dev.compute_marker())
    assert torch.equal(reused, h)


def test_host_memory_a_copy_has_not_landed_in_is_not_touched():
    """[Note: host memory a copy has not landed in]: a copy from the device into host memory (`copy_later`) returns
    at once; until the host has seen it land, an operation of the compute or the update on its destination fails,
    though the stand-in's copy has usually landed by then (a GPU's may not have). Found missing when fp16's overflow
    flag was read without its wait and every test still passed."""
    dev = StandinDevice()
    flag = dev.empty_host(4).view(torch.float32)
    with dev.compute_context():
        found = torch.ones(1)  # device memory, as the compute makes it
    first = dev.copy_later(flag, found, after=dev.compute_marker())
    first.result()  # the copy has run; the host has not looked
    with dev.compute_context(), pytest.raises(standin.StandinOrderingError, match="before the host saw that copy"):
        bool(flag[0] != 0)
    with standin.watching(dev), pytest.raises(standin.StandinOrderingError, match="Device.landed"):
        flag.add_(1.0)
    second = dev.copy_later(dev.empty_host(4).view(torch.float32), found, after=dev.compute_marker())
    assert dev.landed(second)  # a later copy landing: the copy engine ran the first before it
    with standin.watching(dev):
        assert bool(flag[0] != 0)
    dev.copy_later(flag, found, after=dev.compute_marker())
    dev.synchronize()  # every copy seen
    with standin.watching(dev):
        assert bool(flag[0] != 0)


def test_the_compute_stream_reads_host_memory_late():
    """A copy from host memory queued on the compute stream (`to_device`) reads it when the device gets there: until a
    wait covers that copy the host may neither hand the buffer back nor change it ([Note: the compute stream reads
    host memory late])."""
    dev = StandinDevice()
    buf = dev.empty_host(64).view(torch.float32)
    buf.fill_(1.0)
    dev.to_device(buf)
    with pytest.raises(standin.StandinOrderingError, match="may still read it"):
        dev.released(buf)  # an NVMe read or another chunk could take it before the device has read it
    assert dev.landed(dev.compute_reached())  # the host waits for the compute to pass the copy
    dev.released(buf)
    buf.fill_(2.0)
    dev.to_device(buf)
    buf.fill_(3.0)  # the host changes what the queued copy reads
    with pytest.raises(standin.StandinOrderingError, match="changed by the host"):
        dev.synchronize()
    dev.to_device(buf)
    d = dev.empty((16,), torch.float32)
    dev.copy(d, dev.to_device(torch.zeros(16)), after=dev.compute_marker())
    marker = dev.compute_marker()  # recorded after the read: a copy into the buffer after it is ordered behind it
    dev.copy(buf, d, after=marker)
    assert torch.equal(buf, torch.zeros(16))
    dev.to_device(buf)
    with pytest.raises(standin.StandinOrderingError, match="after its marker may still read"):
        dev.copy(buf, d, after=marker)  # ordered before the read: it would race it


def _one_rank_plain_and_strict(config: dict, nvme: str | None, monkeypatch) -> tuple[dict, dict]:
    """One rank trained as configured without the stand-in and under it, the CPU named for both (on a GPU machine the
    plain run would take the GPU); their final weights must be the same bits."""
    plain = parity.run_hetero(0, 1, steps=3, rows=4, config=config, device="cpu", nvme_dir=nvme)
    monkeypatch.setenv("HETERO_STANDIN", "1")
    strict = parity.run_hetero(0, 1, steps=3, rows=4, config=config, device="cpu", nvme_dir=nvme)
    monkeypatch.delenv("HETERO_STANDIN")
    for k, v in plain["state"].items():
        assert torch.equal(strict["state"][k], v), (config, k)
    return plain, strict


def test_a_group_of_one_keeps_a_host_shard_until_the_device_has_read_it(tmp_path, monkeypatch):
    """One rank gathers a stage-3 shard kept in host memory by a copy queued on the compute stream, which reads it when
    the GPU gets there. With the parameters on NVMe and a tight host budget, the shard's host buffer went back to the
    pool as soon as the gather was queued, for the next NVMe read to fill: the shard now stays until a wait covers
    that copy (`ChunkManager.land_later`, [Note: the compute stream reads host memory late])."""
    configs = [
        {
            "zero_stage": 3,
            "offload": {"params": "nvme", "optimizer": "nvme"},
            "memory": {"host_budget": 6 * parity.CHUNK * 4},
        },
        {
            "zero_stage": 3,
            "offload": {"params": "nvme", "optimizer": "nvme"},
            "delayed_param_update": True,
            "delayed_param_update_warmup": 0,
        },
    ]
    for i, config in enumerate(configs):
        plain, strict = _one_rank_plain_and_strict(config, str(tmp_path / str(i)), monkeypatch)
        assert strict["losses"] == plain["losses"], config


def test_a_blocking_copy_between_host_and_device_memory_is_a_wait():
    """[Note: host waits]: a plain `copy_` between host and device memory returns once the bytes have landed, behind
    everything queued on the device before it. One H200 found such a wait a chunk in every update that wrote master
    weights from the host into device parameters, which the stand-in did not count then. Queued with non_blocking, or
    between device buffers, a copy is no wait; `Device.copy_in` queues it and hands back what keeps the host memory."""
    dev = StandinDevice()
    host = dev.empty_host(64).view(torch.float32)
    host.fill_(1.0)
    d = dev.empty((16,), torch.float32)
    with dev.standin.watch():
        d.copy_(host)
        host.copy_(d)
        assert [w for w, _ in dev.standin.waits] == ["aten.copy_.default between host and device memory, blocking"] * 2
        d.copy_(host, non_blocking=True)
        dev.empty((16,), torch.bfloat16).copy_(d)
        late = dev.empty((16,), torch.bfloat16)
        handle = dev.copy_in(late, host)
        assert len(dev.standin.waits) == 2
    assert torch.equal(late, torch.ones(16, dtype=torch.bfloat16))
    with pytest.raises(standin.StandinOrderingError, match="may still read it"):
        dev.released(host)  # the device reads it late: kept until the handle lands
    assert dev.landed(handle)
    dev.released(host)
    assert dev.copy_in(dev.empty((16,), torch.float32), d) is None  # device to device: nothing to keep


def test_parameters_written_up_from_the_host_keep_their_source_until_the_device_has_read_it(tmp_path, monkeypatch):
    """[Note: writing parameters up without a wait] (hetero/zero/copy_up.py): an update on the host writes each chunk's
    new master into parameters on the device with a copy queued on the compute stream, which reads the host memory
    when the GPU gets there. Its chunk (the optimizer's, or the delayed update's values) is neither changed nor handed
    back until then: under a tight host budget the states went to NVMe, and their buffer to the next read, while the
    copy could still read it. The same bits as without the stand-in, in every layout that writes up from the host."""
    tight = {"host_budget": 6 * parity.CHUNK * 4}
    configs = [
        {"zero_stage": 1, "offload": {"optimizer": "host"}},
        {"zero_stage": 0, "offload": {"optimizer": "nvme"}, "memory": tight},
        {"zero_stage": 3, "precision": "bf16", "offload": {"optimizer": "nvme"}, "memory": tight},
        {"zero_stage": 3, "offload": {"optimizer": "nvme"}, "memory": tight},
        {
            "zero_stage": 3,
            "offload": {"optimizer": "nvme"},
            "delayed_param_update": True,
            "delayed_param_update_warmup": 0,
        },
    ]
    for i, config in enumerate(configs):
        plain, strict = _one_rank_plain_and_strict(config, str(tmp_path / str(i)), monkeypatch)
        assert strict["losses"] == plain["losses"], config


def test_device_and_host_memory_are_told_apart_and_not_mixed():
    dev = StandinDevice()
    d = dev.to_device(torch.ones(4))
    h = dev.to_host(torch.ones(4), copy=True)
    assert standin.kind_of(d) == standin.DEVICE and standin.kind_of(h) == standin.HOST
    assert standin.kind_of(dev.to_host(d)) == standin.HOST and standin.kind_of(dev.to_device(h)) == standin.DEVICE
    with dev.compute_context():
        y = d * 2  # computed on the device: device memory
        assert standin.kind_of(y) == standin.DEVICE
        assert standin.kind_of(torch.zeros(3)) == standin.DEVICE  # made inside the compute: on the device
        with pytest.raises(standin.StandinError, match="host-tier tensor"):
            d + h
        d * torch.tensor(3.0)  # a 0-dim host scalar is fine, as with CUDA
    assert standin.collective_rule(h) is not None and standin.collective_rule(torch.ones(2)) is not None
    assert standin.collective_rule(d) is None


def test_device_memory_stays_device_memory_while_any_view_of_it_lives():
    """A compute output's storage is device memory for as long as the storage lives: a view or a detached alias (a
    gradient autograd reshaped, a pipeline stage's output sent on) often outlives the operation's own output. The
    registry once forgot the storage with the first tensor, and NCCL's rule then refused the view."""
    import gc

    dev = StandinDevice()
    d = dev.to_device(torch.ones(4))
    with dev.compute_context():
        out = d * 2
        alias = out.detach()  # no `_base`: nothing keeps `out` itself alive
    del out
    gc.collect()
    assert standin.kind_of(alias) == standin.DEVICE
    assert standin.collective_rule(alias) is None


def test_pinned_host_bytes_follow_the_ledger_and_trim_gives_them_back(monkeypatch):
    monkeypatch.setenv("HETERO_STANDIN", "1")
    model = parity.build()
    cfg = {"zero_stage": 3, "chunk_size": parity.CHUNK, "offload": {"params": "host", "optimizer": "host"}}
    engine = hetero.initialize(model, parity.make_optimizer(model), cfg)
    assert isinstance(engine.device, StandinDevice)
    for x, y in parity.batches(2, 4):
        engine.backward(engine(x, labels=y).loss)
        engine.step()
    host = engine.manager.ledgers[Tier.HOST]
    assert host.current > 0
    assert engine.device.pinned_bytes() == host.current + host.cached
    engine.manager.pools[Tier.HOST].trim()
    assert host.cached == 0 and engine.device.pinned_bytes() == host.current
    engine.close()
    assert engine.device.pinned_bytes() == 0


@pytest.mark.parametrize("pinned", [False, True], ids=["cpu-device", "standin"])
def test_the_update_gives_back_cached_buffers_unless_pinned(tmp_path, monkeypatch, pinned):
    """Buffers the pools cached sit idle through the next phase of a step: the device's from backward through the
    update, and on a CPU device (host memory not pinned) the host's, a window of the states streamed from NVMe,
    through the next forward. The update gives them back, but the device buffers the next forward takes again ([Note:
    what the forward takes again]); pinned host buffers stay (freeing pinned memory waits for the whole GPU, and
    pinning again costs more than the copies it serves)."""
    from hetero.io.swap import storages_exchange
    from hetero.zero.update import Updater

    if pinned:
        monkeypatch.setenv("HETERO_STANDIN", "1")
    else:
        monkeypatch.delenv("HETERO_STANDIN", raising=False)
        monkeypatch.setattr(hetero.device, "default_device", lambda: torch.device("cpu"))
    model = parity.build()
    where = {"params": "nvme", "optimizer": "nvme"}
    cfg = {"zero_stage": 3, "chunk_size": parity.CHUNK, "offload": where, "memory": {"nvme_dir": str(tmp_path)}}
    engine = hetero.initialize(model, parity.make_optimizer(model), cfg)
    assert isinstance(engine.device, StandinDevice) == pinned
    manager = engine.manager
    device, host = manager.ledgers[Tier.DEVICE], manager.ledgers[Tier.HOST]
    at_first_chunk, kept = [], []
    step_one = Updater.step_one

    def spy(self, order, i, *args, **kwargs):
        if i == 0:
            at_first_chunk.append(device.cached)
        return step_one(self, order, i, *args, **kwargs)

    monkeypatch.setattr(Updater, "step_one", spy)
    for x, y in parity.batches(3, 4):
        engine.backward(engine(x, labels=y).loss)
        forward = sum(size * n for size, n in manager.forward_take.items())
        kept.append(forward)
        assert device.cached > forward  # backward cached gradient buffers besides: what the update gives back
        engine.step()
        assert device.cached == forward
        assert (host.cached > 0) if pinned else (host.cached == 0)
    assert at_first_chunk == kept
    # A CPU device's forward gathers into pooled buffers, which stay, where torch lets two storages exchange their
    # memory (`UntypedStorage._swap_data_ptr_`, which torch 2.4-2.6 lack); else its transient storages grow back
    # instead ([Note: transient storage on pooled memory])
    assert pinned or (kept[0] > 0) == storages_exchange()
    engine.close()


def test_manager_moves_under_the_standin(tmp_path, monkeypatch):
    """Device <-> host <-> NVMe moves through the stand-in's copy engine, with staging and markers."""
    monkeypatch.setenv("HETERO_STANDIN", "1")
    with ChunkManager(device_budget=3 << 16, host_budget=4 << 16, nvme_dir=str(tmp_path)) as m:
        chunks = []
        for i in range(8):
            c = m.new_chunk(dtype=torch.float32, capacity=1 << 14)
            s = c.add_tensor(f"t{i}", (1 << 14,))
            m.access(c, Tier.DEVICE)
            c.payload.fill_(float(i))
            c.set_state(s, hetero.memory.TensorState.HOLD)
            chunks.append(c)
        for i, c in enumerate(chunks):
            assert standin.kind_of(m.access(c, Tier.DEVICE)) == standin.DEVICE
            assert torch.equal(c.payload, torch.full((1 << 14,), float(i)))
        assert m.memory_stats()["moved"].get("host->nvme", 0) > 0


def _run_comm_rule(rank: int, world: int) -> list[str]:
    from hetero.comm import init_from_env

    comm = init_from_env()
    seen = []
    for t in (torch.ones(4), StandinDevice().empty_host(16).view(torch.float32)):
        try:
            comm.all_reduce(t)
            seen.append("accepted")
        except CommError as err:
            seen.append(str(err))
    comm.all_reduce(StandinDevice().to_device(torch.ones(4)))  # device memory: fine
    comm.control.all_reduce(torch.ones(4))  # small host values go through the control group
    seen.append(str(comm.control is comm))
    return seen


@pytest.mark.timeout(120)
def test_a_group_of_one_gathers_from_where_the_shard_is(monkeypatch):
    """One rank has nothing to exchange: a stage-3 gather copies the shard from where it lives. Reading it on the tier
    a collective would (the host, for a backend without NCCL's rule) sent every unit's shard from the device to the
    host and back each gather (1.1 GB each way a step of a 551M Llama on one H200)."""
    monkeypatch.setenv("HETERO_STANDIN", "1")
    model = parity.build()
    config = {"zero_stage": 3, "precision": "bf16", "chunk_size": parity.CHUNK}  # bf16: the shard is its own chunk
    engine = hetero.initialize(model, parity.make_optimizer(model), config)
    for x, y in parity.batches(2, 4):
        engine.backward(engine(x, labels=y).loss)
        engine.step()
    moved = engine.memory_stats()["moved"]
    engine.close()
    assert moved == {}, moved


def test_one_rank_with_host_gradients_trains_under_the_standin_as_without_it(tmp_path, monkeypatch):
    """A group of one copies each reduced gradient to the host after a marker taken as the "reduction" (a copy on the
    compute stream) is queued, not when backward completes it later (hetero/zero/host_grads.py): the stand-in runs
    that copy late, so a marker taken before the reduction would land a stale gradient. Stages 0-1 reduce a host
    gradient where it is: a stage-1 group of one once filled a device target from host memory (a GPU refuses that in
    the compute)."""
    configs = [
        {"zero_stage": 1, "offload": {"optimizer": "host"}},
        {"zero_stage": 0, "offload": {"optimizer": "nvme"}, "grad_accumulation_steps": 2},
        {"zero_stage": 3, "offload": {"optimizer": "host"}},
        {"zero_stage": 3, "offload": {"params": "host", "optimizer": "host"}, "grad_accumulation_steps": 2},
    ]
    for i, config in enumerate(configs):
        nvme = str(tmp_path / str(i)) if "nvme" in repr(config) else None
        plain, strict = _one_rank_plain_and_strict(config, nvme, monkeypatch)
        assert strict["losses"] == plain["losses"] and strict["grad_norm"] == plain["grad_norm"], config


def test_a_gradient_written_whole_to_the_host_is_not_zeroed_first(monkeypatch):
    """Stage 3, one rank, gradients on the host: the first micro-batch's reduced gradient is copied down over the
    whole host chunk, so that chunk is not zeroed first (a pass over host memory in backward's hooks: 52 ms of a
    423 ms step on one H100). A second micro-batch adds to it, and the update is exact either way (the parity test
    above)."""
    monkeypatch.setenv("HETERO_STANDIN", "1")
    model = parity.build()
    config = {"zero_stage": 3, "chunk_size": parity.CHUNK, "offload": {"optimizer": "host"}}
    engine = hetero.initialize(model, parity.make_optimizer(model), config)
    grad_numel = {zc.grad.capacity for zc in engine.chunks}
    zeroed = []
    zero_ = torch.Tensor.zero_

    def spy(t):
        if t.numel() in grad_numel and t.dtype == torch.float32:
            zeroed.append(t.numel())
        return zero_(t)

    monkeypatch.setattr(torch.Tensor, "zero_", spy)
    ((x, y),) = parity.batches(1, 4)
    engine.backward(engine(x, labels=y).loss)
    engine.step()
    engine.close()
    assert zeroed == [], f"{len(zeroed)} gradient buffers zeroed"


@pytest.mark.parametrize("stage", [0, 3])
def test_placing_a_built_model_makes_no_host_copy_of_a_chunk(monkeypatch, stage):
    """A built model's weights go to their chunks through a chunk-sized fp32 buffer in device memory: built on the
    host, it sat beside the model's own weights at the peak of placing them (115 MB for the 551M Llama of
    benchmarks/gpu_race.py, where hetero's peak host memory was 1.06x FSDP2's on one H100). Every chunk-sized fp32
    tensor made while placing must be device memory, and the weights must arrive intact."""
    monkeypatch.setenv("HETERO_STANDIN", "1")
    model = parity.build()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    made = []
    factories = {name: getattr(torch, name) for name in ("zeros", "empty")}

    def spy(name):
        def make(*args, **kwargs):
            t = factories[name](*args, **kwargs)
            if t.dtype == torch.float32 and t.numel() == parity.CHUNK:
                made.append(t)
            return t

        return make

    for name in factories:
        monkeypatch.setattr(torch, name, spy(name))
    config = {"zero_stage": stage, "chunk_size": parity.CHUNK}
    engine = hetero.initialize(model, parity.make_optimizer(model), config)
    for name, f in factories.items():
        monkeypatch.setattr(torch, name, f)
    kinds = [standin.kind_of(t) for t in made]
    after = engine.full_state_dict()
    engine.close()
    assert made and all(k == standin.DEVICE for k in kinds), kinds
    assert all(torch.equal(after[k].float(), v.float()) for k, v in before.items())


def _pipeline(rank: int, world: int) -> dict:
    torch.set_num_threads(1)
    out = pipe_parity.run(rank, world, {"zero_stage": 1, "parallel": {"pipeline": 2, "microbatches": 2}})
    return {k: out[k] for k in ("losses", "eval_loss", "eval_fn_loss", "eval_logits")}


@ranks_apart(NEEDS_DEGREES)
@pytest.mark.timeout(300)
def test_a_pipeline_trains_and_evaluates_under_the_standin_as_without_it(monkeypatch):
    """Two pipeline stages: what they send each other (activations, gradients, their headers) and what eval_batch
    shares from the last stage are device memory under NCCL's rule, in train_batch and in eval_batch alike (the
    evaluation once ran its exchanges outside the device's compute, with headers and buffers in host memory)."""
    plain = run_distributed(_pipeline, 2, timeout=120)
    monkeypatch.setenv("HETERO_STANDIN", "1")
    strict = run_distributed(_pipeline, 2, timeout=240)
    for a, b in zip(plain, strict):
        for k in ("losses", "eval_loss", "eval_fn_loss"):
            assert a[k] == b[k], k
        assert torch.equal(a["eval_logits"], b["eval_logits"])


WAIT_FREE = {
    "z3-host": {"zero_stage": 3, "offload": {"params": "host", "optimizer": "host"}},
    "z3-tiles": {"zero_stage": 3, "chunk_size": 1024, "tiling": True},
    "z1-host": {"zero_stage": 1, "offload": {"optimizer": "host"}},
    "z0-nvme-accum": {"zero_stage": 0, "offload": {"optimizer": "nvme"}, "grad_accumulation_steps": 2},
    # The master written up into device parameters from NVMe-streamed states: a wait a chunk on one H200
    "z3-nvme-bf16": {"zero_stage": 3, "precision": "bf16", "offload": {"optimizer": "nvme"}},
    # In fp32 the master follows the shard, filled from the device's before each chunk steps: was a wait a chunk
    "z3-nvme": {"zero_stage": 3, "offload": {"optimizer": "nvme"}},
}  # and three of CONFIGS (below)


@pytest.mark.timeout(300)
def test_forward_backward_and_update_never_wait_for_the_device(tmp_path, monkeypatch):
    """[Note: host waits]: no operation of a step makes the host wait for the device (a value read back, a
    data-dependent size, a copy to pageable memory), in any placement. Found by this check: stage 0-1 gradients
    bound for the host went down parameter by parameter through pageable memory (19 waits a step here), the delayed
    update's flags of used parameters looked device-resident, the tiled embedding counted its hits, and each chunk's
    step made its step count from Python data on the device (`torch.tensor(n, device=...)`: a wait per run of used
    parameters of every chunk, every update), and the update's end read the loss and the gradient's norm back (two
    waits a step; the whole update is watched since, and the norm is read when asked: [Note: the norm read when
    asked], checked here against the same run without the stand-in), and clipping read the norm back before the
    first chunk could step (with every chunk on the device the coefficient is a device scalar since)."""
    monkeypatch.setenv("HETERO_STANDIN", "1")
    more = {k: CONFIGS[k] for k in ("z3-device", "z3-host-delayed", "z3-host-in-backward", "z2-bf16-clip")}
    more["z3-device-sgd"] = {"zero_stage": 3}  # SGD with momentum: whether its buffer exists was read back
    # fp16's overflow check was read back before the update: the kernels skip an overflowed update since ([Note: the
    # overflow check on the device]); with clipping the coefficient is a device scalar there too
    more["z3-device-fp16"] = {"zero_stage": 3, "precision": "fp16"}
    more["z2-fp16-clip"] = {"zero_stage": 2, "precision": "fp16", "grad_clip_norm": 0.05}
    for name, config in {**WAIT_FREE, **more}.items():
        config = {"chunk_size": parity.CHUNK, **config}
        if "nvme" in name:
            config["memory"] = {"nvme_dir": str(tmp_path)}
        optimizer = "sgd" if name.endswith("sgd") else "adamw"
        model = parity.build()
        engine = hetero.initialize(model, parity.make_optimizer(model, optimizer), config)
        for x, y in parity.batches(4, 4):
            engine.backward(engine(x, labels=y).loss)
            engine.step()
        waits = list(engine.device.standin.waits)
        unread = isinstance(engine.updater._norm, torch.Tensor)
        norm, loss = engine.last_grad_norm, engine.metrics()["loss"]
        engine.close()
        assert waits == [], (name, waits[:5])
        assert unread, name
        monkeypatch.delenv("HETERO_STANDIN")
        model = parity.build()
        engine = hetero.initialize(model, parity.make_optimizer(model, optimizer), config)
        for x, y in parity.batches(4, 4):
            engine.backward(engine(x, labels=y).loss)
            engine.step()
        assert (engine.last_grad_norm, engine.metrics()["loss"]) == (norm, loss), name
        engine.close()
        monkeypatch.setenv("HETERO_STANDIN", "1")


@pytest.mark.timeout(300)
def test_gpu_waits_tool_counts_no_wait_in_the_default_placements(tmp_path):
    """tools/gpu_waits.py (on a GPU: torch's sync debug mode) runs here under the stand-in: hetero's step with
    everything on the device, with clipping, with host offload, with the delayed update (and its prediction) and with
    the update in backward, and at stages 0-2 (stage 1 with the optimizer on the host), makes no wait it can see,
    and the norm each configuration reports is a number."""
    import json
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    # Width 64: the same five chunks as the tool's 256, a third of its time (48 s at 256)
    cmd = [sys.executable, os.path.join(root, "tools", "gpu_waits.py"), "--steps", "2", "--embd", "64", "--json"]
    env = {**os.environ, "PYTHONPATH": root}
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=280, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = json.loads(out.stdout.strip().splitlines()[-1])
    assert set(rows) == {
        *("device", "device_clip", "host", "host_delayed", "host_predicted", "host_in_backward"),
        *("stage0", "stage1_host", "stage2", "stage1_host_writes"),
    }
    # The loop's own in-place writes are read back from the device into the host's masters: a wait of the loop's
    # making, one a step for every written chunk together (`adopt_all`; one a chunk before), and no other
    writes = rows.pop("stage1_host_writes")
    assert writes["waits_per_step"] == 1 and all("loop_writes.py" in where for where in writes["where"]), writes
    for name, row in rows.items():
        assert row["waits_per_step"] == 0 and row["where"] == {}, (name, row)
        assert row["grad_norm"] > 0 and row["gpu"] is False, (name, row)
    # The delayed update with the states on NVMe, the parameters on the device: each chunk's master is copied up from
    # the device's shard without a wait ([Note: the master copied up late] in hetero/zero/master.py), and its values
    # written back up without one ([Note: writing parameters up without a wait] in hetero/zero/copy_up.py), as the
    # exact update's are, in fp32 (its master filled the same way, the host waiting for that copy alone) and bf16.
    cmd += ["--nvme-dir", str(tmp_path), "--only", "nvme,nvme_delayed,nvme_predicted"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=280, env={**os.environ, "PYTHONPATH": root})
    assert out.returncode == 0, out.stderr[-3000:]
    for name, row in json.loads(out.stdout.strip().splitlines()[-1]).items():
        assert row["waits_per_step"] == 0 and row["where"] == {}, (name, row)
    cmd[-1] = "nvme"
    out = subprocess.run([*cmd, "--precision", "bf16"], capture_output=True, text=True, timeout=280, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads(out.stdout.strip().splitlines()[-1])["nvme"]["where"] == {}


@ranks_apart(ONLY_SEVERAL)
def test_collectives_take_device_memory_only(monkeypatch):
    monkeypatch.setenv("HETERO_STANDIN", "1")
    for seen in run_distributed(_run_comm_rule, 2, timeout=100):
        assert "NCCL takes device tensors only" in seen[0] and "host-tier tensor" in seen[1], seen
        assert seen[2] == "False"  # a separate control group, as with NCCL


# ---- every ZeRO path under the rules ---------------------------------------------------------------------------------
CONFIGS = {
    "z0-host": {"zero_stage": 0, "offload": {"optimizer": "host"}},
    "z1-nvme": {"zero_stage": 1, "offload": {"optimizer": "nvme"}},
    "z2-host-accum": {"zero_stage": 2, "offload": {"optimizer": "host"}, "grad_accumulation_steps": 2},
    "z3-device": {"zero_stage": 3},
    "z3-nvme": {"zero_stage": 3, "offload": {"params": "nvme", "optimizer": "nvme"}},
    "z3-tight": {
        "zero_stage": 3,
        "offload": {"params": "host", "optimizer": "host"},
        "memory": {"device_budget": 5 * parity.CHUNK * 4},
    },
    "z3-host-delayed": {
        "zero_stage": 3,
        "offload": {"optimizer": "host"},
        "delayed_param_update": True,
        "delayed_param_update_warmup": 0,
    },
    "z3-host-in-backward": {"zero_stage": 3, "offload": {"optimizer": "host"}, "update_in_backward": True},
    "z3-host-clip": {"zero_stage": 3, "offload": {"optimizer": "host"}, "grad_clip_norm": 0.05},
    "z3-act-offload": {"zero_stage": 3, "activation_checkpointing": True, "activation_offload": True},
    "z2-bf16-clip": {"zero_stage": 2, "precision": "bf16", "grad_clip_norm": 0.05},
}


def _run_train_batch(rank: int, world: int, *, meta: bool) -> dict:
    """train_batch with micro-batches (one reduction per batch), from a model built on the meta device (initialised
    on every rank, checksums compared) or normally (rank 0's values broadcast)."""
    torch.manual_seed(0)
    if meta:
        with hetero.lazy_init():
            model = parity.build()
    else:
        model = parity.build()
    cfg = {"zero_stage": 3, "chunk_size": parity.CHUNK, "grad_clip_norm": 0.05, "parallel": {"microbatches": 2}}
    engine = hetero.initialize(model, parity.make_optimizer(model), cfg)
    losses = []
    for x, y in parity.batches(3, 4):
        losses.append(float(engine.train_batch(x[rank * 2 : rank * 2 + 2], y[rank * 2 : rank * 2 + 2])))
    state = engine.full_state_dict()
    engine.close()
    return {"losses": losses, "state": state}


def _run_backward_then_train_batch(rank: int, world: int) -> dict:
    """Stage 1 with its gradient on the host: a step through `engine.backward`, whose backward reduces (on the
    stand-in, as with NCCL, the device's sum kept for it), then `train_batch`'s micro-batches, reduced at the update:
    those sum on the host again ([Note: stage 0-1 gradients summed on the device])."""
    torch.manual_seed(0)
    model = parity.build()
    cfg = {
        "zero_stage": 1,
        "chunk_size": parity.CHUNK,
        "offload": {"optimizer": "host"},
        "parallel": {"microbatches": 2},
    }
    engine = hetero.initialize(model, parity.make_optimizer(model), cfg)
    losses = []
    for i, (x, y) in enumerate(parity.batches(3, 4)):
        x, y = x[rank * 2 : rank * 2 + 2], y[rank * 2 : rank * 2 + 2]
        if i == 0:
            loss = engine(x, labels=y).loss
            engine.backward(loss)
            engine.step()
            losses.append(float(loss))
        else:
            losses.append(float(engine.train_batch(x, y)))
    state = engine.full_state_dict()
    engine.close()
    return {"losses": losses, "state": state}


def _run_configs(rank: int, world: int, nvme_root: str) -> dict:
    torch.set_num_threads(1)
    out = {}
    for name, cfg in CONFIGS.items():
        nvme = os.path.join(nvme_root, name) if "nvme" in name else None
        r = parity.run_hetero(rank, world, steps=3, rows=4, config=cfg, nvme_dir=nvme)
        out[name] = {"losses": r["losses"], "state": r["state"], "grad_norm": r["grad_norm"]}
    out["train-batch-meta"] = _run_train_batch(rank, world, meta=True)
    out["train-batch"] = _run_train_batch(rank, world, meta=False)
    out["backward-then-train-batch"] = _run_backward_then_train_batch(rank, world)
    return out


@pytest.mark.timeout(900)
def test_every_zero_path_trains_under_the_standin_as_without_it(tmp_path, monkeypatch):
    plain = run_distributed(_run_configs, 2, str(tmp_path / "plain"), timeout=400)[0]
    monkeypatch.setenv("HETERO_STANDIN", "1")
    monkeypatch.setenv("TORCH_DISTRIBUTED_DEBUG", "DETAIL")
    strict = run_distributed(_run_configs, 2, str(tmp_path / "strict"), timeout=800)[0]
    for name in plain:
        assert strict[name]["losses"] == plain[name]["losses"], name
        # A gradient kept on the host is summed on the device on its way there (hetero/zero/host_grads.py): the
        # norm the update reports must be the one taken from the host copy, bit for bit.
        assert strict[name].get("grad_norm") == plain[name].get("grad_norm"), name
        for k, v in plain[name]["state"].items():
            assert torch.equal(strict[name]["state"][k], v), (name, k)
