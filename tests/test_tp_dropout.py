"""Dropout under 1D tensor parallelism over 2 ranks ([Note: dropout under tensor parallelism]): replicated tensors
draw the same masks on every tensor rank, sharded ones (attention's heads, the MLP's features, Megatron-SP's
positions) their own; activation checkpointing's recomputation draws the masks of the forward; and a model trains
exactly as the plain model does when that model draws each part of a sharded tensor's mask from its rank's stream.
Under a grid ([Note: dropout under a grid]) every rank draws its own masks, and under a pipeline every stage does."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import hetero
from hetero.comm import Comm
from hetero.parallel import apply_tensor_parallel
from hetero.parallel.tp_rng import rank_seed, set_streams, shared_draw
from tests.dist import NEEDS_DEGREES, ranks_apart, run_distributed

VOCAB, SEQ, ROWS, STEPS, P = 64, 8, 2, 3, 0.3


def _gpt2() -> nn.Module:
    import transformers

    torch.manual_seed(0)
    cfg = transformers.GPT2Config(
        vocab_size=VOCAB, n_positions=16, n_embd=32, n_layer=2, n_head=2, resid_pdrop=P, embd_pdrop=P, attn_pdrop=P
    )
    cfg._attn_implementation = "eager"  # its attention dropout is F.dropout, which the masks test records
    return transformers.GPT2LMHeadModel(cfg)


def _batches() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, VOCAB, (ROWS, SEQ), generator=g) for _ in range(STEPS)]


class _Recorder:
    """The masks of every F.dropout a GPT-2 forward draws, in order (the eager attention's and nn.Dropout's)."""

    def __init__(self) -> None:
        self.masks: list[torch.Tensor] = []
        self.plain = F.dropout

    def __call__(self, x: torch.Tensor, p: float = 0.5, training: bool = True, inplace: bool = False) -> torch.Tensor:
        y = self.plain(x, p, training, inplace)
        self.masks.append((y == 0) & (x != 0))  # what this dropout zeroed
        return y


def _masks(rank: int, world: int) -> list[str]:
    comm = Comm.world()
    seen = []
    for sequence in (False, True):
        model = _gpt2()
        apply_tensor_parallel(model, "auto", comm, sequence=sequence)
        record = _Recorder()
        F.dropout = record  # GPT-2's eager attention and nn.Dropout call it through the module
        try:
            model(_batches()[0])
        finally:
            F.dropout = record.plain
        theirs = comm.all_gather_object(record.masks)[1 - rank]
        # embedding, then per layer: attention probabilities, attention's output, the MLP's output
        kinds = ["embd"] + ["attn", "resid", "mlp"] * 2
        assert [tuple(m.shape) for m in record.masks][:2] == [
            (ROWS, SEQ // (2 if sequence else 1), 32),
            (ROWS, 1, 8, 8),
        ]
        for kind, mine, other in zip(kinds, record.masks, theirs, strict=True):
            sharded = kind == "attn" or sequence  # heads; under SP every one of them holds its own positions
            assert torch.equal(mine, other) != sharded, f"sequence={sequence} {kind}: masks equal={not sharded}"
            assert mine.any() and not mine.all()  # a mask was drawn (equal masks would otherwise prove nothing)
        seen.append(f"sequence={sequence}")
    return seen


@ranks_apart(NEEDS_DEGREES)
@pytest.mark.timeout(120)
def test_sharded_masks_differ_between_ranks_replicated_ones_agree(cpu_device):
    pytest.importorskip("transformers")
    assert run_distributed(_masks, 2, timeout=100) == [["sequence=False", "sequence=True"]] * 2


def _train(rank: int, world: int) -> None:
    """GPT-2 with every dropout on, through the engine, with and without activation checkpointing."""
    runs = {}
    for sequence in (False, True):
        for ckpt in (False, True):
            config = {
                "zero_stage": 1,
                "parallel": {"tensor": 2, "sequence": sequence},
                "activation_checkpointing": ckpt,
            }
            model = _gpt2()
            engine = hetero.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-2), config)
            assert any(hasattr(p, "_hetero_tp") for p in model.parameters())
            assert (engine.activations is not None) == ckpt
            losses = []
            for ids in _batches():
                loss = engine(ids, labels=ids).loss
                engine.backward(loss)
                engine.step()
                losses.append(loss.item())
            params = {n: p.detach().clone() for n, p in model.named_parameters()}
            engine.close()
            runs[sequence, ckpt] = losses, params
            # replicated parameters stay bit-identical over the tensor group
            theirs = Comm.world().all_gather_object(params)[1 - rank]
            for name, p in model.named_parameters():
                if not hasattr(p, "_hetero_tp"):
                    assert torch.equal(params[name], theirs[name]), f"sequence={sequence} ckpt={ckpt}: {name}"
        # the recomputation drew the forward's masks: the same steps, bit for bit
        (plain_losses, plain), (ckpt_losses, ckpt_params) = runs[sequence, False], runs[sequence, True]
        assert plain_losses == ckpt_losses, (sequence, plain_losses, ckpt_losses)
        for name, p in plain.items():
            assert torch.equal(p, ckpt_params[name]), f"sequence={sequence}: {name} differs under checkpointing"


@ranks_apart(NEEDS_DEGREES)
@pytest.mark.timeout(200)
def test_replicas_agree_and_recomputation_redraws_the_masks(cpu_device):
    pytest.importorskip("transformers")
    run_distributed(_train, 2, timeout=180)


class _MLP(nn.Module):
    def __init__(self, width: int, sharded_drop: nn.Module) -> None:
        super().__init__()
        self.fc, self.proj = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)
        self.inner, self.out = sharded_drop, nn.Dropout(P)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.proj(self.inner(F.gelu(self.fc(x)))))


class _Toy(nn.Module):
    def __init__(self, sharded_drop: nn.Module, width: int = 16) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed, self.drop = nn.Embedding(VOCAB, width), nn.Dropout(P)
        self.mlp = _MLP(width, sharded_drop)
        self.head = nn.Linear(width, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.drop(self.embed(ids))
        logits = self.head(x + self.mlp(x))  # parallel_input: the module's input enters the region whole
        return F.cross_entropy(logits.flatten(0, 1), ids.flatten())


class _RanksDropout(nn.Module):
    """The plain model's dropout of the MLP's features that draws each rank's part of them as that rank draws it
    under tensor parallelism: from its own stream, seeded from the shared one where the region begins."""

    def __init__(self, world: int) -> None:
        super().__init__()
        self.world = world

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shared = shared_draw()
        after = torch.get_rng_state()
        parts = []
        for r, part in enumerate(x.chunk(self.world, -1)):
            set_streams(rank_seed(shared, r))
            parts.append(F.dropout(part.contiguous(), P, self.training))  # drawn in the order of a rank's own part
        torch.set_rng_state(after)
        return torch.cat(parts, -1)


def _exact(rank: int, world: int) -> None:
    comm = Comm.world()
    ref, tp = _Toy(_RanksDropout(world)), _Toy(nn.Dropout(P))
    apply_tensor_parallel(tp, {"mlp": "parallel_input", "mlp.fc": "colwise", "mlp.proj": "rowwise"}, comm)
    ref_opt, tp_opt = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (ref, tp))
    torch.manual_seed(3)  # where every run of the test starts drawing
    for ids in _batches():
        for model, opt in ((ref, ref_opt), (tp, tp_opt)):
            state = torch.get_rng_state()
            loss = model(ids)
            loss.backward()
            opt.step()
            opt.zero_grad()
            if model is ref:
                ref_loss, torch_state = loss.detach(), torch.get_rng_state()
                torch.set_rng_state(state)  # the tensor-parallel model draws from where the plain one began
        # the same masks: the losses agree to fp32 rounding (the row-parallel sum adds in another order)
        torch.testing.assert_close(loss.detach(), ref_loss, rtol=1e-5, atol=1e-6)
        assert torch.equal(torch.get_rng_state(), torch_state)  # and the shared stream moved as the plain one's
    full = {n: p for n, p in ref.named_parameters()}
    for name, p in tp.named_parameters():
        info = getattr(p, "_hetero_tp", None)
        want = full[name].detach() if info is None else full[name].detach().chunk(world, info.dim)[rank]
        torch.testing.assert_close(p.detach(), want, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")


@ranks_apart(NEEDS_DEGREES)
@pytest.mark.timeout(120)
def test_training_with_dropout_equals_the_plain_model_drawing_each_ranks_part(cpu_device):  # no engine: CPU ranks
    run_distributed(_exact, 2, timeout=100)


class _FailOnce(nn.Module):
    """A dropout that raises the first time, in the middle of the sharded region."""

    def __init__(self) -> None:
        super().__init__()
        self.armed = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.armed:
            self.armed = False
            raise RuntimeError("a forward that fails inside the region")
        return F.dropout(x, P, self.training)


def _after_a_failure(rank: int, world: int) -> bool:
    comm = Comm.world()
    model = _Toy(_FailOnce())
    apply_tensor_parallel(model, {"mlp.fc": "colwise", "mlp.proj": "rowwise"}, comm)  # no module closes the region
    ids = _batches()[0]
    with pytest.raises(RuntimeError, match="fails inside the region"):
        model(ids)
    loss = model(ids)  # its embedding's dropout draws the shared stream again: the ranks compute one model
    return bool(torch.equal(*comm.all_gather_object(loss.detach())))


@ranks_apart(NEEDS_DEGREES)
@pytest.mark.timeout(120)
def test_a_forward_that_failed_inside_the_region_leaves_it(cpu_device):  # no engine: CPU tensors, CPU ranks
    assert run_distributed(_after_a_failure, 2, timeout=100) == [True, True]


# ---- grids ([Note: dropout under a grid]) and pipeline stages --------------------------------------------------------


def _grid_masks(rank: int, world: int, modes: list[tuple[str, int | None]]) -> list[str]:
    from hetero.parallel.grid import Grid, apply_grid_parallel

    comm, seen = Comm.world(), []
    for mode, depth in modes:
        model, grid = _gpt2(), Grid.build(comm, mode, depth)
        apply_grid_parallel(model, "auto", grid)
        record = _Recorder()
        F.dropout = record
        try:
            model(torch.cat(_batches()[:2]))  # 4 rows: the batch parts of every mode
        finally:
            F.dropout = record.plain
        every = comm.all_gather_object(record.masks)
        assert tuple(record.masks[0].shape) == (4 // grid.batch_parts, SEQ, 32 // grid.q)
        for i, mine in enumerate(record.masks):  # embedding, then per layer: attention probabilities, attention, MLP
            assert mine.any() and not mine.all()
            for r in range(world):
                if r != rank:  # every rank holds another block of every activation: another mask
                    assert not torch.equal(mine, every[r][i]), f"{mode} dropout {i}: ranks {rank} and {r} drew one mask"
        # the shared stream is back after the forward, where every rank's is
        assert all(torch.equal(s, torch.get_rng_state()) for s in comm.all_gather_object(torch.get_rng_state()))
        seen.append(mode)
    return seen


@ranks_apart(NEEDS_DEGREES)
@pytest.mark.timeout(120)
def test_each_rank_of_a_2d_grid_draws_its_own_masks(cpu_device):
    pytest.importorskip("transformers")
    assert run_distributed(_grid_masks, 4, [("2d", None)], timeout=100) == [["2d"]] * 4


@ranks_apart(NEEDS_DEGREES)
@pytest.mark.timeout(200)
def test_each_rank_of_a_2_5d_and_a_3d_grid_draws_its_own_masks(cpu_device):
    """2.5D's depth layers hold other rows (not copies), 3D's attention another layout (alt): every rank's own."""
    pytest.importorskip("transformers")
    assert run_distributed(_grid_masks, 8, [("2.5d", 2), ("3d", None)], timeout=180) == [["2.5d", "3d"]] * 8


class _GridToy(nn.Module):
    """Embedding, an MLP and a head, a dropout after each of the first three, its loss a `loss_function` (which a
    grid replaces by the grid cross entropy)."""

    def __init__(self, dropout: Any, width: int = 16) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed, self.lm_head = nn.Embedding(VOCAB, width), nn.Linear(width, VOCAB)
        self.fc, self.proj = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)
        self.drops = [dropout() for _ in range(3)]

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.drops[0](self.embed(ids))
        x = x + self.drops[2](self.proj(self.drops[1](F.gelu(self.fc(x)))))
        return self.loss_function(self.lm_head(x), ids)

    def loss_function(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten())


class _BlockStreams:
    """The plain model's dropouts drawing each 2D grid rank's block (rows i, hidden part j of rank i q + j) from
    that rank's stream, seeded from the shared one when the model is called, as under the grid."""

    def __init__(self, q: int) -> None:
        self.q, self.states = q, []

    def start(self, *_: Any) -> None:
        shared = shared_draw()
        after = torch.get_rng_state()
        self.states = []
        for r in range(self.q * self.q):
            set_streams(rank_seed(shared, r))
            self.states.append(torch.get_rng_state())
        torch.set_rng_state(after)

    def dropout(self, x: torch.Tensor) -> torch.Tensor:
        after, q = torch.get_rng_state(), self.q
        rows = []
        for i, part in enumerate(x.chunk(q, 0)):
            blocks = []
            for j, block in enumerate(part.chunk(q, -1)):
                torch.set_rng_state(self.states[i * q + j])
                blocks.append(F.dropout(block.contiguous(), P, True))
                self.states[i * q + j] = torch.get_rng_state()
            rows.append(torch.cat(blocks, -1))
        torch.set_rng_state(after)
        return torch.cat(rows, 0)


def _grid_exact(rank: int, world: int) -> tuple[list[float], ...]:
    from hetero.parallel.grid import Grid, apply_grid_parallel

    streams = _BlockStreams(2)
    refs = [_GridToy(lambda: streams.dropout) for _ in range(2)]
    refs[0].to(torch.float64)  # the exact reference, which fp32's rounding is measured against
    for ref in refs:
        ref.register_forward_pre_hook(streams.start)
    grid = _GridToy(lambda: nn.Dropout(P))
    plan = {"embed": "vocab", "fc": "colwise", "proj": "rowwise", "lm_head": "vocab_head"}
    apply_grid_parallel(grid, plan, Grid.build(Comm.world(), "2d"))
    models = (*refs, grid)
    opts = [torch.optim.SGD(m.parameters(), lr=0.5) for m in models]
    losses: tuple[list[float], ...] = ([], [], [])
    torch.manual_seed(3)
    for ids in _batches():
        state = torch.get_rng_state()
        ends = []
        for model, opt, out in zip(models, opts, losses):
            torch.set_rng_state(state)  # each model draws from where the others began
            loss = model(torch.cat([ids, ids.flip(0)]))  # 4 rows: 2 per batch part
            loss.backward()
            opt.step()
            opt.zero_grad()
            out.append(loss.item())
            ends.append(torch.get_rng_state())
        assert all(torch.equal(e, ends[0]) for e in ends)  # and the shared stream moved alike
    return losses


@ranks_apart(NEEDS_DEGREES)
@pytest.mark.timeout(120)
def test_a_grid_trains_as_the_plain_model_drawing_each_ranks_block(cpu_device):
    try:
        from tests import tolerance
    except ImportError:  # tests/ itself on sys.path
        import tolerance  # type: ignore[no-redef]

    for exact, plain, got in run_distributed(_grid_exact, 4, timeout=100):
        assert len(set(exact)) == STEPS  # the masks moved the loss: three steps, three losses
        tolerance.assert_losses(got, exact, plain, dtype=torch.float32)


def _layout(rank: int, world: int, parallel: dict) -> dict:
    """GPTPipe with dropout under `parallel`, with and without activation checkpointing."""
    from hetero.models.gpt import GPTConfig
    from hetero.models.gpt_pipe import TP_PLAN, GPTPipe

    out: dict = {}
    parallel = {**parallel, "tensor_plan": TP_PLAN}
    for ckpt in (False, True):
        torch.manual_seed(0)
        cfg = GPTConfig(vocab_size=VOCAB, n_layer=2, n_head=2, n_embd=32, block_size=16, dropout=P, tie_weights=False)
        model = GPTPipe(cfg)
        config = {"zero_stage": 1, "activation_checkpointing": ckpt, "parallel": parallel}
        engine = hetero.initialize(model, torch.optim.SGD(model.parameters(), lr=0.5), config)
        torch.manual_seed(3)  # every rank draws alike from here
        record = _Recorder()
        F.dropout = record
        try:
            rows = [torch.cat([ids, ids.flip(0)]) for ids in _batches()]  # 4 rows: 2 micro-batches, 2 batch parts
            losses = [float(engine.train_batch(x, x)) for x in rows]
        finally:
            F.dropout = record.plain
        out[ckpt] = {
            "losses": losses,
            "params": {n: p.detach().clone() for n, p in model.named_parameters()},
            "rng": torch.get_rng_state(),  # after the steps: the shared stream
            "masks": record.masks,
        }
        out["stage"] = engine.mesh.pp_rank
        engine.close()
    return out


PIPELINE = {"pipeline": 2, "microbatches": 2, "pipeline_split": ["layers.1"]}


def _check_stages(results: list[dict], tensor: int, stages: int = 2) -> None:
    by_stage: dict[int, list[dict]] = {}
    for r in results:
        by_stage.setdefault(r["stage"], []).append(r)
    assert sorted(by_stage) == list(range(stages)) and all(len(s) == tensor for s in by_stage.values())
    for stage, peers in by_stage.items():
        for a in peers:
            for b in peers:
                if a is b:
                    continue
                mine, theirs = a[False]["masks"], b[False]["masks"]
                assert len(mine) == len(theirs) >= 2 * STEPS  # 2 dropouts or more per step
                for i, (m, t) in enumerate(zip(mine, theirs)):
                    assert m.any() and not m.all()
                    assert not torch.equal(m, t), f"stage {stage}, dropout {i}: two tensor ranks drew one mask"
                for ckpt in (False, True):
                    assert torch.equal(a[ckpt]["rng"], b[ckpt]["rng"]), f"stage {stage}: the ranks' streams differ"
        for r in peers:  # the recomputation drew the forward's masks: the same run, bit for bit
            assert r[False]["losses"] == r[True]["losses"]
            for name, p in r[False]["params"].items():
                assert torch.equal(p, r[True]["params"][name]), f"stage {stage}: {name} differs under checkpointing"


@ranks_apart(NEEDS_DEGREES)
@pytest.mark.timeout(200)
def test_sequence_parallel_stages_of_a_pipeline_draw_their_ranks_masks(cpu_device):
    """Each pipeline stage of a Megatron-SP model draws its tensor ranks' own masks (the stage after the one holding
    `sequence_scatter` drew one mask for both), gives the program back the shared stream after its forward (the one
    holding it kept the rank's, so what drew after a step differed between the tensor ranks), and recomputes the
    forward's masks under activation checkpointing."""
    parallel = {"tensor": 2, "sequence": True, **PIPELINE}
    _check_stages(run_distributed(_layout, 4, parallel, timeout=180), tensor=2)


@ranks_apart(NEEDS_DEGREES)
@pytest.mark.timeout(300)
def test_the_stages_of_a_pipelined_grid_draw_their_ranks_masks(cpu_device):
    """A pipeline stage runs its units, never the model whose call brackets a grid's region: each stage does."""
    parallel = {"tensor": 4, "tensor_mode": "2d", **PIPELINE}
    _check_stages(run_distributed(_layout, 8, parallel, timeout=280), tensor=4)


@ranks_apart(NEEDS_DEGREES)
@pytest.mark.timeout(200)
def test_a_grid_through_the_engine_recomputes_its_masks(cpu_device):
    _check_stages(run_distributed(_layout, 4, {"tensor": 4, "tensor_mode": "2d"}, timeout=180), tensor=4, stages=1)


@ranks_apart(NEEDS_DEGREES)
@pytest.mark.timeout(200)
@pytest.mark.parametrize("pipeline", [False, True])
def test_ulysses_ranks_draw_their_own_masks(pipeline, cpu_device):
    """Ulysses cuts the sequence between `sequence_scatter` and `sequence_gather` as Megatron-SP does: its ranks
    drew one mask for their different positions (and its attention's heads), with or without a pipeline."""
    parallel = {"tensor": 2, "sequence": "ulysses", **(PIPELINE if pipeline else {})}
    results = run_distributed(_layout, 2 * (1 + pipeline), parallel, timeout=180)
    _check_stages(results, tensor=2, stages=1 + pipeline)
