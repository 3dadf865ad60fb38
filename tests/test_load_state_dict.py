"""`model.load_state_dict(...)` after `hetero.initialize`, as a loop ported from DDP loads its checkpoint after wrapping
the model ([Note: loading weights into a held model] in hetero/zero/handed_over.py).

Before the Note, the values went into the parameters' views of the chunks and the first update stepped from the old
fp32 master weights: the loaded weights were gone after one step (at stage 0 in fp32, 1.0 off plain PyTorch's), and
at stage 3 the copy failed. Each run below first moves every weight away from the model's initial values (through
`gathered_parameters(modify=True)`, masters included), then loads the initial values with the model's own
`load_state_dict`, and must then train as plain PyTorch from those values ([Note: tolerances from the arithmetic] in
tests/tolerance.py). In bf16 the master weights take the fp32 values loaded, not their bf16 rounding.
"""

from __future__ import annotations

import pytest
import torch

import hetero
from hetero.errors import HeteroError

try:
    from tests import parity
    from tests.dist import run_distributed
except ImportError:  # tests/ itself on sys.path
    import parity  # type: ignore[no-redef]
    from dist import run_distributed  # type: ignore[no-redef]

STEPS, ROWS = 3, 4


def _load_initial_at_start(engine: hetero.Engine, step: int) -> None:
    if step != 0:
        return
    with engine.gathered_parameters(modify=True), torch.no_grad():
        for p in engine.module.parameters():
            p.add_(0.5)
    result = engine.module.load_state_dict(parity.initial_state())
    assert not result.missing_keys and not result.unexpected_keys


def _run(rank: int, world: int, config: dict) -> dict:
    return parity.run_hetero(rank, world, steps=STEPS, rows=ROWS, config=config, on_step=_load_initial_at_start)


@pytest.mark.parametrize(
    "stage,precision", [(0, "fp32"), (1, "fp32"), (2, "fp32"), (3, "fp32"), (0, "bf16"), (3, "bf16")]
)
def test_a_state_dict_loaded_after_initialize_trains_as_plain_pytorch(stage, precision):
    config = {"zero_stage": stage, "precision": precision}
    results = run_distributed(_run, 2, config, timeout=300)
    parity.check(results[0], precision, steps=STEPS, rows=ROWS)


def _engine(stage: int) -> tuple[torch.nn.Module, hetero.Engine]:
    model = parity.build()
    return model, hetero.initialize(model, parity.make_optimizer(model), {"zero_stage": stage, "chunk_size": 4096})


@pytest.mark.parametrize("stage", [0, 3])
def test_loading_keeps_torchs_behaviour_around_it(stage):
    model, engine = _engine(stage)
    initial = parity.initial_state()
    moved = {k: v + 1.0 for k, v in initial.items()}
    # strict: torch's own key check, which raises after loading what matched (the master weights follow them, as
    # the next update must); strict=False reports what it skipped.
    with pytest.raises(RuntimeError, match="Missing key"):
        model.load_state_dict({k: v for k, v in moved.items() if k != "ln_f.weight"})
    full = engine.full_state_dict()
    assert all(torch.equal(full[k], initial[k] if k == "ln_f.weight" else moved[k]) for k in initial)
    result = model.load_state_dict({**moved, "extra": torch.zeros(1)}, strict=False)
    assert result.unexpected_keys == ["extra"]
    assert all(torch.equal(engine.full_state_dict()[k], moved[k]) for k in moved)
    # A submodule loads its own keys; inside the user's own gathered block the call goes straight through.
    layer = {k[len("layers.0.") :]: v for k, v in initial.items() if k.startswith("layers.0.")}
    model.layers[0].load_state_dict(layer)
    with engine.gathered_parameters(modify=True):
        model.ln_f.load_state_dict({"weight": initial["ln_f.weight"]})
    full = engine.full_state_dict()
    for k in initial:
        want = initial[k] if k.startswith(("layers.0.", "ln_f.")) else moved[k]
        assert torch.equal(full[k], want), k
    with pytest.raises(HeteroError, match=r"assign=True"):
        model.load_state_dict(initial, assign=True)
    engine.close()
    assert "load_state_dict" not in model.__dict__, "close gives the modules their class's load_state_dict back"


@pytest.mark.parametrize("stage", [0, 3])
def test_fp32_values_loaded_into_a_bf16_model_keep_their_precision_in_the_master_weights(stage):
    model = parity.build()
    engine = hetero.initialize(
        model, parity.make_optimizer(model), {"zero_stage": stage, "precision": "bf16", "chunk_size": 4096}
    )
    # Values bf16 cannot hold: each is 1 + a small fraction below bf16's resolution at 1.
    loaded = {
        k: 1.0 + torch.rand(v.shape, generator=torch.Generator().manual_seed(3)) * 2.0**-10
        for k, v in parity.initial_state().items()
    }
    model.load_state_dict(loaded)
    for zc in engine.trainable:
        master, _ = zc.optimizer_views()
        for info in zc.spec.params:
            want = loaded[info.name].reshape(-1)[info.start : info.start + info.numel]
            assert torch.equal(master[info.offset : info.offset + info.numel].cpu(), want), info.name
    engine.close()


def test_a_pickled_or_copied_held_model_has_its_class_methods_back():
    # The stand-in methods closed over the engine: torch.save(model) failed ("Can't pickle local object"), and a
    # deepcopy's load_state_dict loaded into the original. A copy is held by no engine.
    import copy
    import io

    model, engine = _engine(0)
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    loaded.double()  # a plain module again: converting it is its own business
    twin = copy.deepcopy(model)
    twin.load_state_dict({k: v + 1.0 for k, v in parity.initial_state().items()})
    initial = parity.initial_state()
    assert all(torch.equal(v, initial[k]) for k, v in engine.full_state_dict().items()), "the original is untouched"
    engine.close()


def test_a_partial_state_dict_gathers_only_what_it_names():
    # An adapter's or a head's weights loaded into a stage-3 model: the rest stays sharded (it was all gathered).
    model, engine = _engine(3)
    gathered = []
    views_gathered = engine.views.gathered

    def spy(params=None, **kwargs):
        gathered.append(None if params is None else sorted(id(p) for p in params))
        return views_gathered(params, **kwargs)

    engine.views.gathered = spy
    initial = parity.initial_state()
    result = model.load_state_dict({"ln_f.weight": initial["ln_f.weight"] + 1.0}, strict=False)
    assert gathered == [[id(model.ln_f.weight)]]
    assert "ln_f.weight" not in result.missing_keys and len(result.missing_keys) == len(initial) - 1
    assert torch.equal(engine.full_state_dict()["ln_f.weight"], initial["ln_f.weight"] + 1.0)
    engine.close()
