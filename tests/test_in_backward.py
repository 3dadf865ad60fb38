"""`update_in_backward`: each chunk steps during the backward before an update, with the same arithmetic as the update
after backward ([Note: the update in backward])."""

from __future__ import annotations

import pytest
import torch

import hetero
from hetero.errors import ConfigError
from tests.dist import OWN_BATCHES, ranks_apart

try:
    from tests import branchy, parity, tolerance
    from tests.dist import run_distributed
except ImportError:  # tests/ itself on sys.path
    import branchy  # type: ignore[no-redef]
    import parity  # type: ignore[no-redef]
    import tolerance  # type: ignore[no-redef]
    from dist import run_distributed  # type: ignore[no-redef]

STEPS, ROWS = 4, 4

CONFIGS = {
    "z0-device": {"zero_stage": 0},
    "z1-host-accum": {"zero_stage": 1, "offload": {"optimizer": "host"}, "grad_accumulation_steps": 2},
    "z2-nvme": {"zero_stage": 2, "offload": {"optimizer": "nvme"}},
    "z3-device-accum": {"zero_stage": 3, "grad_accumulation_steps": 2},
    "z3-nvme": {"zero_stage": 3, "offload": {"optimizer": "nvme", "params": "nvme"}},
    "z3-nvme-some-host": {  # three chunks' shards on the host ([Note: parameter shards kept on the host])
        "zero_stage": 3,
        "offload": {"optimizer": "nvme", "params": "nvme", "params_host_bytes": 3 * parity.CHUNK * 4 // 2},
    },
    "z3-nvme-tight": {
        "zero_stage": 3,
        "offload": {"optimizer": "nvme", "params": "nvme"},
        "memory": {"device_budget": 8 * parity.CHUNK * 4, "host_budget": 8 * parity.CHUNK * 4},
    },
}
CONFIGS["z3-host"] = {"zero_stage": 3, "offload": {"params": "host", "optimizer": "host"}}
# The placements whose copies and collectives the stand-in checks; with the states in host memory the chunks' math
# runs on the worker there ([Note: the update in backward off the autograd thread]).
STANDIN = ("z1-host-accum", "z3-nvme", "z3-host")


def _probe(rank: int, world: int, nvme: str) -> dict:
    """After the backward before an update the parameters are new and the update is not yet counted; step() counts
    it; what would lose it (another backward, a checkpoint) before that is an error."""
    model = parity.build()
    cfg = {"zero_stage": 3, "update_in_backward": True, "chunk_size": parity.CHUNK}
    engine = hetero.initialize(model, parity.make_optimizer(model), cfg)
    (x, y), _ = parity.batches(2, ROWS)
    x, y = x[rank * 2 : rank * 2 + 2], y[rank * 2 : rank * 2 + 2]
    before = engine.full_state_dict()
    engine.backward(engine(x, labels=y).loss)
    after = engine.full_state_dict()
    out = {
        "changed_in_backward": sum(not torch.equal(before[k], after[k]) for k in before),
        "params": len(before),
        "counted_before_step": engine.global_steps,
    }
    try:
        engine.backward(engine(x, labels=y).loss)
    except RuntimeError as e:
        out["second_backward"] = str(e)
    try:
        engine.save_checkpoint(nvme)
    except RuntimeError as e:
        out["checkpoint"] = str(e)
    engine.step()
    out["counted_after_step"] = engine.global_steps
    out["norm"] = engine.updater.last_grad_norm
    engine.close()
    return out


def _run(rank: int, world: int, names: list[str], nvme: str, probe: bool) -> dict:
    torch.set_num_threads(1)
    out: dict = {}
    for name in names:
        for on in (False, True):
            cfg = {**CONFIGS[name], "update_in_backward": on}
            out[name, on] = parity.run_hetero(
                rank, world, steps=STEPS, rows=ROWS, config=cfg, nvme_dir=f"{nvme}/{name}-{on}"
            )
    for stage in (0, 1, 3):  # a branch and experts that differ by rank: the used parameters agreed at issue
        cfg = {"zero_stage": stage, "chunk_size": 512, "update_in_backward": True}
        out["branchy", stage] = branchy.run(rank, world, cfg, steps=4)
    if probe:
        out["probe"] = _probe(rank, world, f"{nvme}/ckpt")
    return out


@ranks_apart(OWN_BATCHES)
@pytest.mark.timeout(400)
@pytest.mark.parametrize("standin", [False, True], ids=["cpu", "standin"])
def test_the_update_in_backward_is_the_update_after_backward_bit_for_bit(tmp_path, monkeypatch, standin):
    if standin:
        monkeypatch.setenv("HETERO_STANDIN", "1")
    names = list(STANDIN) if standin else list(CONFIGS)
    results = run_distributed(_run, 2, names, str(tmp_path), not standin, timeout=360)[0]
    for name in names:
        after, during = results[name, False], results[name, True]
        # The same chunks step with the same gradients, states and hyperparameters: the same bits.
        assert during["losses"] == after["losses"], name
        for k, v in after["state"].items():
            assert torch.equal(during["state"][k], v), (name, k)
        accum = CONFIGS[name].get("grad_accumulation_steps", 1)
        parity.check(during, steps=STEPS, rows=ROWS, accum=accum)
    exact_losses, exact = branchy.reference(4, 2, torch.float64)
    plain_losses, plain = branchy.reference(4, 2)
    for stage in (0, 1, 3):
        got = results["branchy", stage]
        tolerance.assert_losses(got["losses"], exact_losses, plain_losses, dtype=torch.float32)
        tolerance.assert_weights(got["state"], exact, plain, dtype=torch.float32)
    if not standin:
        probe = results["probe"]
        assert probe["changed_in_backward"] == probe["params"]  # every parameter stepped during backward
        assert probe["counted_before_step"] == 0 and probe["counted_after_step"] == 1
        assert probe["norm"] is not None and probe["norm"] > 0
        assert "call engine.step() after every backward" in probe["second_backward"]
        assert "call engine.step() first" in probe["checkpoint"]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_one_rank_steps_host_states_on_the_worker_after_the_gradients_copy(monkeypatch, stage):
    """[Note: the update in backward off the autograd thread]: under the stand-in (device memory of its own, each
    gradient's copy down landing late on its copy engine), one rank with its states in host memory steps every
    chunk's math on the worker, which waits for the gradient's copy: the same bits as the update after backward."""
    import threading

    from hetero.zero import in_backward

    monkeypatch.setenv("HETERO_STANDIN", "1")
    threads: list[str] = []
    step_chunk = in_backward.step_chunk

    def spy(*args, **kwargs):
        threads.append(threading.current_thread().name)
        return step_chunk(*args, **kwargs)

    monkeypatch.setattr(in_backward, "step_chunk", spy)
    cfg = {"zero_stage": stage, "offload": {"optimizer": "host"}, "grad_accumulation_steps": 2}
    if stage == 3:
        cfg["offload"]["params"] = "host"
    after = parity.run_hetero(0, 1, steps=STEPS, rows=ROWS, config=cfg)
    assert threads == []  # the update after backward steps on the training thread, through update.py
    during = parity.run_hetero(0, 1, steps=STEPS, rows=ROWS, config={**cfg, "update_in_backward": True})
    assert threads and all(t.startswith("hetero-update") for t in threads), threads
    assert len(threads) % STEPS == 0  # every chunk of every update
    assert during["losses"] == after["losses"]
    for k, v in after["state"].items():
        assert torch.equal(during["state"][k], v), k


def test_update_in_backward_refuses_what_needs_the_whole_gradient_first():
    assert hetero.Config.from_dict({"update_in_backward": True}).update_in_backward
    for extra, named in (
        ({"grad_clip_norm": 1.0}, "grad_clip_norm 1.0"),
        ({"precision": "fp16"}, "precision 'fp16'"),
        ({"delayed_param_update": True, "offload": {"optimizer": "host"}}, "delayed_param_update"),
    ):
        with pytest.raises(ConfigError, match=f"update_in_backward: .*{named}.*needs the whole gradient"):
            hetero.Config.from_dict({"update_in_backward": True, **extra})
    both = {"grad_clip_norm": 1.0, "delayed_param_update": True, "offload": {"optimizer": "host"}}
    with pytest.raises(ConfigError, match="grad_clip_norm 1.0 and delayed_param_update need .* turn them off"):
        hetero.Config.from_dict({"update_in_backward": True, **both})
    with pytest.raises(ConfigError, match="update_in_backward: expected true or false"):
        hetero.Config.from_dict({"update_in_backward": "yes"})


class _Boom(Exception):
    pass


def _fail_then_train(rank: int, world: int, root: str) -> dict:
    """Accumulating 2 micro-batches a step, with and without the update in backward; one micro-batch raises in its
    backward, as an out-of-memory batch does: the first of the second step (2), whose batch the loop skips, or the
    last (3), after which it loads the checkpoint saved at the start, as the error says to."""
    torch.set_num_threads(1)
    out = {}
    for fails in (2, 3):
        for stage in (1, 3):
            for on in (False, True):
                model = parity.build()
                armed = {"on": False}

                def hook(module, grad_in, grad_out, armed=armed):
                    if armed["on"]:
                        raise _Boom("out of memory (simulated)")

                model.layers[0].register_full_backward_hook(hook)
                cfg = {"zero_stage": stage, "chunk_size": parity.CHUNK, "grad_accumulation_steps": 2}
                engine = hetero.initialize(model, parity.make_optimizer(model), {**cfg, "update_in_backward": on})
                ckpt = engine.save_checkpoint(f"{root}/{fails}-{stage}-{on}")
                local = ROWS // world
                notes: list[str] = []
                for i, (x, y) in enumerate(parity.batches(8, ROWS)):
                    armed["on"] = i == fails
                    x, y = x[rank * local : (rank + 1) * local], y[rank * local : (rank + 1) * local]
                    try:
                        engine.backward(engine(x, labels=y).loss)
                    except _Boom as e:
                        notes += getattr(e, "__notes__", [])
                        if fails == 3:
                            engine.load_checkpoint(ckpt)
                        continue
                    engine.step()
                state = {k: v.float() for k, v in engine.full_state_dict().items()}
                out[fails, stage, on] = {"state": state, "notes": notes}
                engine.close()
    return out


@pytest.mark.timeout(200)
def test_a_failed_backward_is_ended_and_dropped_and_a_checkpoint_resumes_after_it(tmp_path):
    """[Note: a backward that fails]: a backward that raises is ended and the accumulation's gradients dropped. With
    the update in backward, one before the update steps nothing and is dropped alike: the same bits as the update
    after backward. It passed as it was, unended: its part of the gradient went into the next update (stage 1), or
    the next backward failed on a cryptic error (stage 3). The update's own backward stops stepping chunks at the
    failure; the error says how many had stepped and to load the last checkpoint, and that load resumes the run
    as it resumes the update after backward (before, the next backward failed on an internal error)."""
    results = run_distributed(_fail_then_train, 2, str(tmp_path), timeout=180)
    for r in results:
        for fails in (2, 3):
            for stage in (1, 3):
                off, on = r[fails, stage, False], r[fails, stage, True]
                for k, v in off["state"].items():
                    assert torch.equal(on["state"][k], v), (fails, stage, k)
                assert off["notes"] == [] and (on["notes"] == []) == (fails == 2), on["notes"]
        assert all("Load the last checkpoint" in n for n in r[3, 1, True]["notes"]), r[3, 1, True]["notes"]
