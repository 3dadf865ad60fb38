"""What a training loop ported from plain PyTorch does with hetero: what works as it did, and what stops with an error
naming the fix instead of training nothing ([Note: the optimizer handed over] in hetero/zero/handed_over.py).

Each refusal was measured before it existed: `loss.backward()` then `optimizer.step()`, or `loss.backward()` then
`engine.step()` at stage 3, gave every step the first step's loss; unfreezing a parameter frozen at initialize left
it at its initial value while plain PyTorch trained it. Freezing a parameter for some steps and unfreezing it again
is plain PyTorch's arithmetic (its update skipped while it has no gradient, Adam's step count included), checked
against the float64 run as every parity test is ([Note: tolerances from the arithmetic] in tests/tolerance.py).
"""

from __future__ import annotations

import contextlib
import errno
import warnings

import pytest
import torch
from torch import nn

import hetero
from hetero.errors import HeteroError
from tests.dist import OWN_BATCHES, RANKS_DIFFER, ranks_apart

try:
    from tests import parity, tolerance
    from tests.dist import run_distributed
except ImportError:  # tests/ itself on sys.path
    import parity  # type: ignore[no-redef]
    import tolerance  # type: ignore[no-redef]
    from dist import run_distributed  # type: ignore[no-redef]


def _engine(stage: int, **config) -> tuple[nn.Module, torch.optim.Optimizer, hetero.Engine]:
    model = parity.build()
    opt = parity.make_optimizer(model)
    engine = hetero.initialize(model, opt, {"zero_stage": stage, "chunk_size": parity.CHUNK, **config})
    return model, opt, engine


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    return parity.batches(1, 2)[0]


@pytest.mark.parametrize("stage", [0, 3])
def test_a_loops_own_backward_is_refused_naming_engine_backward(stage):
    model, opt, engine = _engine(stage)
    x, y = _batch()
    before = {k: v.clone() for k, v in engine.full_state_dict().items()}
    with pytest.raises(HeteroError, match=r"outside engine\.backward.*Call engine\.backward\(loss\)"):
        engine(x, labels=y).loss.backward()
    # The update the loop would have taken next changes nothing either way: no weight moved.
    after = engine.full_state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    engine.close()


def test_a_tiled_layers_gradient_outside_engine_backward_is_refused():
    # chunk_size below the embedding's size: its weight is split into tiles, whose gradients take another path.
    model, opt, engine = _engine(3, chunk_size=1024)
    assert engine.tiles.tiled, "the embedding should be tiled at this chunk size"
    x, y = _batch()
    with pytest.raises(HeteroError, match=r"outside engine\.backward"):
        engine(x, labels=y).loss.backward()
    engine.close()


def test_the_optimizer_handed_over_refuses_what_would_do_nothing_and_is_restored_at_close():
    model, opt, engine = _engine(3)
    x, y = _batch()
    engine.backward(engine(x, labels=y).loss)
    with pytest.raises(HeteroError, match=r"AdamW\.step\(\).*engine\.backward\(loss\) then engine\.step\(\)"):
        opt.step()
    engine.step()
    with pytest.raises(HeteroError, match=r"state_dict\(\).*engine\.save_checkpoint"):
        opt.state_dict()
    with pytest.raises(HeteroError, match=r"load_state_dict\(\).*before hetero\.initialize"):
        opt.load_state_dict({})
    with pytest.raises(HeteroError, match=r"add_param_group\(\).*every param group up front"):
        opt.add_param_group({"params": [nn.Parameter(torch.zeros(2))]})
    opt.zero_grad()  # clears nothing that exists: a loop keeping it loses nothing
    # A scheduler built on it afterwards still drives the update's learning rate (the param groups are shared).
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5)
    assert engine.optimizer.param_groups[0]["lr"] == pytest.approx(0.5 * 3e-3)
    with pytest.raises(HeteroError, match=r"AdamW\.step\(\)"):
        opt.step()  # through the scheduler's counting wrapper
    del sched
    engine.close()
    assert not {"step", "state_dict", "load_state_dict", "add_param_group"} & set(vars(opt))
    assert opt.state_dict()["param_groups"][0]["lr"] == pytest.approx(0.5 * 3e-3)


def test_a_scheduler_built_before_initialize_keeps_its_wrapper_after_close():
    model = parity.build()
    opt = parity.make_optimizer(model)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    wrapper = vars(opt)["step"]  # torch's schedulers wrap optimizer.step on the instance to count its calls
    engine = hetero.initialize(model, opt, {"zero_stage": 0}, lr_scheduler=sched)
    with pytest.raises(HeteroError):
        opt.step()
    engine.close()
    assert vars(opt)["step"] is wrapper


def test_unfreezing_a_parameter_frozen_at_initialize_is_refused_before_its_backward():
    model = parity.build()
    for p in model.layers[0].parameters():
        p.requires_grad_(False)
    opt = parity.make_optimizer(model)
    engine = hetero.initialize(model, opt, {"zero_stage": 3, "chunk_size": parity.CHUNK})
    x, y = _batch()
    engine.backward(engine(x, labels=y).loss)
    engine.step()
    model.layers[0].attn.q_proj.weight.requires_grad_(True)
    loss = engine(x, labels=y).loss
    with pytest.raises(HeteroError, match=r"'layers\.0\.attn\.q_proj\.weight' had requires_grad False.*Leave it"):
        engine.backward(loss)
    engine.close()


def _frozen_for_a_while(rank: int, world: int) -> dict:
    torch.set_num_threads(1)
    out = {}
    for stage in (1, 3):
        out[stage] = parity.run_hetero(
            rank, world, steps=6, rows=4, config={"zero_stage": stage}, freeze=("layers.0.",), frozen_steps=(2, 4)
        )
    return out


@pytest.mark.timeout(300)
def test_freezing_a_parameter_for_some_steps_trains_like_pytorch_world2():
    results = run_distributed(_frozen_for_a_while, 2, timeout=240)[0]
    init = parity.build().state_dict()
    for stage, result in results.items():
        parity.check(result, "fp32", steps=6, rows=4, freeze=("layers.0.",), frozen_steps=(2, 4))
        # Against the run that never froze it: the frozen steps changed the trajectory (the check is not vacuous).
        name = "layers.0.attn.q_proj.weight"
        assert not torch.equal(result["state"][name], init[name]), stage
    plain = parity.cached_reference("fp32", steps=6, rows=4)[1]
    assert not torch.allclose(results[3]["state"]["layers.0.attn.q_proj.weight"], plain["layers.0.attn.q_proj.weight"])


def _two_micro_batches_a_step(rank: int, world: int, no_sync: bool) -> dict:
    """A loop summing two backwards into each update itself (`grad_accumulation_steps` 1, one `engine.step()` after
    the second), as plain PyTorch does with two `backward()` calls before `optimizer.step()`; no_sync: the first
    inside `engine.no_sync()`, as DDP's accumulation loop has it."""
    torch.set_num_threads(1)
    out = {}
    data = parity.batches(8, 4)
    for name, config in {
        "0": {"zero_stage": 0},
        "1": {"zero_stage": 1},
        "1-host": {"zero_stage": 1, "offload": {"optimizer": "host"}},
        "2": {"zero_stage": 2},
        "3": {"zero_stage": 3},
    }.items():
        model = parity.build()
        engine = hetero.initialize(model, parity.make_optimizer(model), {"chunk_size": parity.CHUNK, **config})
        losses = []
        for step in range(4):
            total = torch.zeros(())
            for micro, (x, y) in enumerate(data[2 * step : 2 * step + 2]):
                checks = engine.check.seq  # one a collective
                with engine.no_sync() if no_sync and micro == 0 else contextlib.nullcontext():
                    loss = engine(x[2 * rank : 2 * rank + 2], labels=y[2 * rank : 2 * rank + 2]).loss
                    engine.backward(loss / 2)
                if no_sync and engine.stage <= 1:  # stages 0-1 reduce at an accumulation's end; 2-3 every backward
                    assert (engine.check.seq > checks) == (micro == 1), (name, micro)
                total += loss.detach().cpu() / 2
            engine.step()
            engine.comm.control.all_reduce(total, op="avg")
            losses.append(total.item())
        assert engine.global_steps == 4
        out[name] = {"losses": losses, "state": {k: v.float() for k, v in engine.full_state_dict().items()}}
        engine.close()
    return out


@ranks_apart(OWN_BATCHES)
@pytest.mark.timeout(300)
@pytest.mark.parametrize("no_sync", [False, True], ids=["backwards", "no_sync"])
def test_two_backwards_before_one_step_sum_as_in_pytorch_world2(no_sync):
    # Before the fix, stage 1 counted the first backward's gradient again in the second's reduce-scatter: its
    # weights 0.02 away from plain PyTorch's after four steps. engine.no_sync() is DDP's.
    results = run_distributed(_two_micro_batches_a_step, 2, no_sync, timeout=240)[0]
    for name, result in results.items():
        try:
            parity.check(result, "fp32", steps=4, rows=4, accum=2)
        except AssertionError as e:
            raise AssertionError(f"{name}: {e}") from e


def _loss_with_a_target_from_the_same_model(model, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The loss plus a pull towards the model's own outputs on other inputs, computed without autograd in the middle
    of the step (between the forward and its backward), as consistency or self-distillation losses do."""
    out = model(x, labels=y)
    with torch.no_grad():
        target = model(x.flip(1)).logits
    return out.loss + 0.1 * (out.logits - target).pow(2).mean()


def _target_mid_step(rank: int, world: int) -> dict:
    torch.set_num_threads(1)
    out = {}
    data = parity.batches(4, 4)
    for stage in (0, 3):
        model = parity.build()
        engine = hetero.initialize(model, parity.make_optimizer(model), {"zero_stage": stage, "chunk_size": 4096})
        for x, y in data:
            lo, hi = 2 * rank, 2 * rank + 2
            engine.backward(_loss_with_a_target_from_the_same_model(engine, x[lo:hi], y[lo:hi]))
            engine.step()
        out[stage] = {k: v.float() for k, v in engine.full_state_dict().items()}
        engine.close()
    return out


@ranks_apart(OWN_BATCHES)
@pytest.mark.timeout(300)
def test_a_forward_without_autograd_inside_a_training_step_world2():
    # Before the fix, at stage 3 the forward without autograd ended the step and released what its backward needed:
    # "the gradient of 'pos_embed.weight' arrived after every unit using it had ended its backward".
    results = run_distributed(_target_mid_step, 2, timeout=240)[0]
    _assert_like_plain(results, _loss_with_a_target_from_the_same_model)


def test_the_engine_answers_for_its_model_as_deepspeeds_does():
    # A loop written for DeepSpeed's engine calls engine.train(), engine.eval(), engine.parameters(): the engine
    # passes what it lacks to its model, but not what would move the parameters out of its chunks.
    model, opt, engine = _engine(3)
    assert engine.eval() is engine and not model.training
    assert engine.train() is engine and model.training
    assert [n for n, _ in engine.named_parameters()] == [n for n, _ in model.named_parameters()]
    assert engine.lm_head is model.lm_head
    for mover in ("to", "cuda", "half", "float"):
        assert not hasattr(engine, mover)
        with pytest.raises(AttributeError, match=rf"engine\.{mover}\(\): hetero places the parameters"):
            getattr(engine, mover)
    with pytest.raises(AttributeError, match="neither the engine nor its model"):
        engine.no_such_thing  # noqa: B018
    with pytest.raises(AttributeError):
        engine._parameters  # noqa: B018 (private names are never the model's)
    engine.close()


@ranks_apart(RANKS_DIFFER)
@pytest.mark.timeout(300)
def test_evaluating_on_one_rank_at_stage_3_stops_every_rank_saying_why_world2():
    # A forward only rank 0 runs meets the other rank's next gathers: the collective check stops both at once (not
    # after comm_timeout), and says what to do.
    for message in run_distributed(_one_rank_calls, 2, 3, "evaluate", "", timeout=240):
        assert "about to run different collectives" in message and "`if rank == 0`" in message, message


def _one_rank_calls(rank: int, world: int, stage: int, call: str, root: str) -> str:
    """Train three steps; after the second, rank 0 alone makes `call`. Returns the mismatch error's message."""
    torch.set_num_threads(1)
    model, opt, engine = _engine(stage, comm_timeout=120)
    x, y = parity.batches(1, 4)[0]
    try:
        for step in range(3):
            engine.backward(engine(x[2 * rank : 2 * rank + 2], labels=y[2 * rank : 2 * rank + 2]).loss)
            engine.step()
            if step == 1 and rank == 0:
                if call == "save_checkpoint":
                    engine.save_checkpoint(root)
                elif call == "full_state_dict":
                    torch.save(engine.full_state_dict(), f"{root}/model.pt")
                elif call == "load_state_dict":  # [Note: loading weights into a held model]: every rank loads
                    model.load_state_dict(parity.initial_state())
                else:  # an evaluation
                    with torch.no_grad():
                        engine.eval()
                        engine(x, labels=y)
                        engine.train()
    except hetero.errors.CollectiveMismatchError as e:
        return str(e)
    finally:
        engine.close()
    return "trained on"


@ranks_apart(RANKS_DIFFER)
@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "stage,call",
    [(0, "save_checkpoint"), (3, "save_checkpoint"), (3, "full_state_dict"), (0, "load_state_dict")],
)
def test_saving_on_rank_0_alone_stops_every_rank_saying_why_world2(tmp_path, stage, call):
    # Before, rank 0's checkpoint met rank 1's next collective: gloo aborted rank 0 in native code ("Received data
    # size doesn't match expected size") and rank 1 trained on. A load_state_dict on rank 0 alone at stages 0-2 (and
    # gathered_parameters(modify=True)) hung both ranks at rank 0's broadcast of the values.
    for message in run_distributed(_one_rank_calls, 2, stage, call, str(tmp_path), timeout=240):
        assert "are collective: every rank calls them" in message, message
        assert ("checkpoint (save_checkpoint" if call == "save_checkpoint" else "gathered_parameters") in message
    assert not list(tmp_path.iterdir()), "nothing is written when the ranks disagree"


def _wrapped_models(rank: int, world: int) -> list[str]:
    import torch.distributed as dist

    try:
        from torch.distributed.fsdp import fully_shard
    except ImportError:  # torch 2.4-2.5: FSDP2 under its first name
        from torch.distributed._composable.fsdp import fully_shard  # type: ignore[no-redef]

    if not dist.is_initialized():  # a group of one needs none for hetero; DDP and fully_shard do
        dist.init_process_group("gloo")
    messages = []
    for wrap in ("ddp", "fully_shard"):
        model = parity.build()
        if wrap == "ddp":
            model = nn.parallel.DistributedDataParallel(model)
        else:
            fully_shard(model.layers[1])
        try:
            hetero.initialize(model, parity.make_optimizer(model), {"zero_stage": 3})
        except hetero.errors.ConfigError as e:
            messages.append(str(e))
    return messages


@pytest.mark.timeout(120)
def test_a_model_wrapped_for_data_parallelism_is_refused_naming_what_to_pass():
    # [Note: a model already wrapped for data parallelism]: two data parallelisms would reduce every gradient twice.
    ddp, sharded = run_distributed(_wrapped_models, 1, timeout=100)[0]
    assert "the model is a DistributedDataParallel" in ddp and "(model.module, the one it wraps)" in ddp, ddp
    assert "module 'layers.1' is a FSDPModule" in sharded and "without fully_shard" in sharded, sharded
    with pytest.raises(hetero.errors.ConfigError, match=r"the model is a DataParallel.*model\.module"):
        hetero.initialize(nn.DataParallel(parity.build()), None, {})
    model, opt, engine = _engine(0)
    with pytest.raises(hetero.errors.ConfigError, match=r"got Engine \(an engine: pass its model, engine\.module\)"):
        hetero.initialize(engine, None, {})
    engine.close()


def test_a_model_another_engine_holds_is_refused_until_it_closes():
    model, opt, engine = _engine(3)
    x, y = _batch()
    engine.backward(engine(x, labels=y).loss)
    engine.step()
    # Before: the second engine's backward met the first one's hooks, or (stage 3) read released parameters.
    with pytest.raises(hetero.errors.ConfigError, match=r"'embed\.weight' belongs to an open hetero engine"):
        hetero.initialize(model, parity.make_optimizer(model), {"zero_stage": 0})
    weights = engine.full_state_dict()
    engine.close()
    with pytest.raises(hetero.errors.ConfigError, match=r"has no values: .* closing \(engine\.full_state_dict\(\)"):
        hetero.initialize(model, parity.make_optimizer(model), {"zero_stage": 0})
    fresh = parity.build()
    fresh.load_state_dict(weights)
    again = hetero.initialize(fresh, parity.make_optimizer(fresh), {"zero_stage": 3, "chunk_size": parity.CHUNK})
    assert all(torch.equal(v, weights[k]) for k, v in again.full_state_dict().items())
    again.close()


def test_a_deepspeed_style_tag_given_as_client_state_is_refused(tmp_path):
    model, opt, engine = _engine(0)
    with pytest.raises(TypeError, match=r"second argument is client_state.*Pass tag='global_step10'"):
        engine.save_checkpoint(tmp_path, "global_step10")  # DeepSpeed's save_checkpoint(save_dir, tag)
    assert not list(tmp_path.iterdir())
    saved = engine.save_checkpoint(tmp_path, {"epoch": 3}, tag="global_step10")
    assert saved.endswith("global_step10") and engine.load_checkpoint(saved) == {"epoch": 3}
    engine.save_checkpoint(tmp_path, {"epoch": 4}, tag="global_step20")
    # DeepSpeed's load_checkpoint(load_dir, tag): the tag under the root, not its latest
    assert engine.load_checkpoint(tmp_path, "global_step10") == {"epoch": 3}
    assert engine.load_checkpoint(tmp_path) == {"epoch": 4}
    engine.close()


def test_deepspeeds_engine_names_answer_with_hetero_figures():
    model, opt, engine = _engine(2, grad_accumulation_steps=2, precision="fp16")
    x, y = _batch()
    assert engine.was_step_applied() is False  # as DeepSpeed's: no update applied yet
    engine.backward(engine(x, labels=y).loss)
    engine.step()  # half an accumulation: still none
    assert engine.was_step_applied() is False
    for _ in range(3):
        engine.backward(engine(x, labels=y).loss)
        engine.step()
    assert engine.get_lr() == [g["lr"] for g in opt.param_groups] == [3e-3, 3e-3]
    assert engine.get_global_grad_norm() == engine.last_grad_norm is not None
    assert engine.was_step_applied() is not engine.last_update_skipped
    assert engine.gradient_accumulation_steps() == 2 and engine.zero_optimization_stage() == 2
    engine.close()


def _two_losses(model, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    out = model(x, labels=y)
    return out.loss, 0.01 * out.logits.pow(2).mean()


def _backward_twice_through_one_graph(rank: int, world: int) -> dict:
    """Two backwards through one forward's graph (`retain_graph=True`), then one step: the gradients add up."""
    torch.set_num_threads(1)
    out = {}
    for stage in (0, 1, 2, 3):
        model, opt, engine = _engine(stage)
        for x, y in parity.batches(4, 4):
            first, second = _two_losses(engine, x[2 * rank : 2 * rank + 2], y[2 * rank : 2 * rank + 2])
            engine.backward(first, retain_graph=True)
            engine.backward(second)
            engine.step()
        out[stage] = {k: v.float() for k, v in engine.full_state_dict().items()}
        engine.close()
    return out


@ranks_apart(OWN_BATCHES)
@pytest.mark.timeout(300)
def test_retain_graph_for_a_second_backward_world2():
    # Before, engine.backward took no retain_graph (DeepSpeed's takes it), and at stage 3 the second backward's
    # gradients came after the first one's reductions ("arrived after every unit using it had ended its backward").
    results = run_distributed(_backward_twice_through_one_graph, 2, timeout=240)[0]

    def both_halves(model, x, y):  # each rank's half, its two losses, averaged over the ranks
        return sum(sum(_two_losses(model, x[2 * r : 2 * r + 2], y[2 * r : 2 * r + 2])) for r in range(2)) / 2

    _assert_like_plain(results, both_halves)


def _assert_like_plain(results: dict, loss_of) -> None:
    """Each run's weights (by key) against plain PyTorch's on the whole batch of `parity.batches(4, 4)`, in float64
    (exact) and fp32 (the scale of rounding: tests/tolerance.py); loss_of(model, x, y): the whole batch's loss."""
    runs = {}
    for dtype in (torch.float64, torch.float32):
        model = parity.build().to(dtype)
        opt = parity.make_optimizer(model)
        for x, y in parity.batches(4, 4):
            loss_of(model, x, y).backward()
            opt.step()
            opt.zero_grad()
        runs[dtype] = model.state_dict()
    for key, state in results.items():
        try:
            tolerance.assert_weights(state, runs[torch.float64], runs[torch.float32], dtype=torch.float32)
        except AssertionError as e:
            raise AssertionError(f"{key}: {e}") from e


@pytest.mark.parametrize("stage", [0, 3])
def test_casting_or_moving_the_model_after_initialize_is_refused_and_a_no_op_goes_through(stage):
    # [Note: casting or moving a held model]: model.double() after initialize swapped in detached copies, and every
    # step's loss was the first one's (stage 0); at stage 3 it failed reading a released parameter.
    model, opt, engine = _engine(stage)
    model.register_buffer("scale", torch.ones(2, dtype=torch.float64))  # a buffer converts as before
    before = {k: v.clone() for k, v in engine.full_state_dict().items()}
    for cast in (
        lambda m: m.double(),
        lambda m: m.half(),
        lambda m: m.to(torch.bfloat16),
        lambda m: m.to_empty(device="meta"),
    ):
        with pytest.raises(HeteroError, match=r"would detach them from hetero's chunks.*\"precision\""):
            cast(model)
    with pytest.raises(HeteroError, match=r"would detach"):
        model.layers[0].half()  # a submodule too
    # Changing nothing goes through, at stage 3 without reading a released parameter.
    here = engine.device.torch_device
    assert model.to(here) is model and model.float() is model
    if here.type == "cpu":
        assert model.cpu() is model
    else:  # on a GPU, to the host is a move
        with pytest.raises(HeteroError, match=r"would detach"):
            model.cpu()
    assert model.scale.dtype == torch.float32
    after = engine.full_state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    x, y = _batch()
    losses = []
    for _ in range(3):
        loss = engine(x, labels=y).loss
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach()))
    assert losses[2] < losses[1] < losses[0], losses  # still training the chunks
    engine.close()
    assert "_apply" not in model.__dict__, "close gives the modules their class's _apply back"


def test_a_scheduler_the_engine_steps_and_the_loop_steps_too_is_refused_before_the_wrong_rate_is_used():
    # [Note: a loop stepping what the engine steps]: StepLR(gamma=0.5) stepped by both gave 0.25x the rate per update.
    model = parity.build()
    opt = parity.make_optimizer(model)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    engine = hetero.initialize(model, opt, {"zero_stage": 0, "chunk_size": parity.CHUNK}, lr_scheduler=sched)
    x, y = _batch()
    rates = []
    for _ in range(2):  # the engine alone: halved once per update
        engine.backward(engine(x, labels=y).loss)
        engine.step()
        rates.append(engine.get_lr()[0])
    assert rates[1] == rates[0] / 2
    sched.step()  # the loop's own, as it had it before hetero
    engine.backward(engine(x, labels=y).loss)
    before = engine.full_state_dict()
    with pytest.raises(HeteroError, match=r"moved from step 2 to 3.*remove the loop's scheduler\.step\(\)"):
        engine.step()
    assert all(torch.equal(before[k], v) for k, v in engine.full_state_dict().items()), "no update at the wrong rate"
    engine.close()


def test_a_ddp_style_accumulation_loop_with_grad_accumulation_steps_warns_once():
    # engine.step() every 4 micro-batches with grad_accumulation_steps 4 updated every 16: a warning says so.
    model, opt, engine = _engine(0, grad_accumulation_steps=4)
    x, y = _batch()
    with pytest.warns(UserWarning, match=r"4 forward/backward pairs ran without engine\.step\(\).*updates every 16"):
        for i in range(8):
            engine.backward(engine(x, labels=y).loss)
            if (i + 1) % 4 == 0:
                engine.step()
    assert engine.global_steps == 0
    engine.close()
    # The loop as hetero has it, and DDP's with no_sync at grad_accumulation_steps 1, are quiet.
    for gas, ddp in ((4, False), (1, True)):
        model, opt, engine = _engine(0, grad_accumulation_steps=gas)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            for i in range(8):
                last = (i + 1) % 4 == 0
                with engine.no_sync() if ddp and not last else contextlib.nullcontext():
                    engine.backward(engine(x, labels=y).loss)
                if last or not ddp:
                    engine.step()
        assert engine.global_steps == 2, (gas, ddp)
        engine.close()


@pytest.mark.parametrize("stage", [0, 3])
def test_a_module_added_after_initialize_is_refused_at_its_first_backward(stage):
    # A head swapped in after initialize took gradients in .grad and was never updated (stages 0 and 3).
    model, opt, engine = _engine(stage)
    model.lm_head = nn.Linear(32, 64, bias=False, device=engine.device.torch_device)
    x, y = _batch()
    with pytest.raises(HeteroError, match=r"'lm_head\.weight' \(shape \[64, 32\]\) is not one hetero\.initialize"):
        engine.backward(engine(x, labels=y).loss)
    engine.close()


def test_deepspeeds_config_queries_answer_and_batch_sizes_say_where_they_are():
    # Before, each of these was "neither the engine nor its model has an attribute ...".
    model, opt, engine = _engine(1, grad_clip_norm=0.5, precision="bf16")
    assert (engine.gradient_clipping(), engine.zero_optimization()) == (0.5, True)
    assert (engine.fp16_enabled(), engine.bfloat16_enabled()) == (False, True)
    assert engine.get_mom() == [g["betas"] for g in opt.param_groups]  # DeepSpeed's: Adam's betas
    for name in ("train_batch_size", "train_micro_batch_size_per_gpu"):
        with pytest.raises(HeteroError, match=rf"engine\.{name}\(\): hetero does not load data.*data loader's"):
            getattr(engine, name)()
    engine.close()
    model, opt, engine = _engine(0)
    assert (engine.gradient_clipping(), engine.zero_optimization(), engine.fp16_enabled()) == (0.0, False, False)
    engine.close()


def test_deepspeeds_checkpoint_keywords_say_what_hetero_does(tmp_path):
    """A script ported from DeepSpeed passes its checkpoint keywords: each is named with hetero's way (a bare
    "unexpected keyword argument" before), and nothing is written or read."""
    model, opt, engine = _engine(1)
    said = r"save_checkpoint: save_latest=False \(DeepSpeed's keyword\) is not available: hetero always moves"
    with pytest.raises(TypeError, match=said):
        engine.save_checkpoint(tmp_path / "ckpt", save_latest=False)
    assert not (tmp_path / "ckpt").exists()
    engine.save_checkpoint(tmp_path / "ckpt")
    said = r"load_module_only=True \(DeepSpeed's keyword\) is not available: .*consolidate"
    with pytest.raises(TypeError, match=said) as err:
        engine.load_checkpoint(tmp_path / "ckpt", load_module_only=True, load_optimizer_states=False)
    assert "load_optimizer_states=False (DeepSpeed's keyword)" in str(err.value)
    engine.close()


def test_an_update_that_fails_partway_says_it_was_partial(monkeypatch):
    """A disk that fails in the middle of an update (an NVMe write-back) leaves the chunks before it stepped and the
    rest not: stepping again would step the first ones twice. The error says so and names the way back, keeping its
    own type (the disk's error said only "free disk space", and a retried step trained on from mixed states)."""
    from hetero.zero.update import Updater

    model, opt, engine = _engine(1)
    assert len(engine.updater.chunks) >= 2
    real, calls = Updater._step_chunk, []

    def fails_second(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(self, *args, **kwargs)

    monkeypatch.setattr(Updater, "_step_chunk", fails_second)
    x, y = _batch()
    engine.backward(engine(x, labels=y).loss)
    with pytest.raises(OSError, match="No space left") as err:
        engine.step()
    notes = "\n".join(getattr(err.value, "__notes__", []))
    n = len(engine.updater.chunks)
    assert f"the update stopped at chunk 2 of {n} (chunks 1-1 of {n} had stepped" in notes, notes
    assert "load the last checkpoint" in notes
    engine.close()
