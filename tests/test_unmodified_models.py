"""hetero trains unmodified models to the same losses as plain PyTorch: Hugging Face GPT-2, Llama and BERT built
from configs, a CNN with batch norm, a module some steps skip, a parameter used twice in one pass."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from torch import nn

import hetero
from tests import tolerance
from tests.dist import OWN_BATCHES, ranks_apart, run_distributed


def _double(batch):
    """Floating inputs in float64, for the exact reference run."""
    if isinstance(batch, torch.Tensor):
        return batch.double() if batch.is_floating_point() else batch
    if isinstance(batch, (list, tuple)):
        return type(batch)(_double(b) for b in batch)
    if isinstance(batch, dict):
        return {k: _double(v) for k, v in batch.items()}
    return batch


def _references(model, batches, loss_of, make_opt=None):
    """Plain PyTorch in float64 (the exact run) and in fp32 (the scale of rounding error): see tests/tolerance.py."""
    exact = _train(copy.deepcopy(model).double(), [_double(b) for b in batches], loss_of=loss_of, make_opt=make_opt)
    return exact, _train(model, batches, loss_of=loss_of, make_opt=make_opt)


def _compare(got, refs):
    (losses, state), ((exact_losses, exact), (plain_losses, plain)) = got, refs
    tolerance.assert_losses(losses, exact_losses, plain_losses, dtype=torch.float32)
    tolerance.assert_weights(state, exact, plain, dtype=torch.float32)


def _train(model, batches, *, engine_cfg=None, loss_of, steps_cfg=None, make_opt=None):
    """Losses and final state of plain PyTorch (engine_cfg None) or of hetero. make_opt(params): the optimizer
    (AdamW by default)."""
    model = copy.deepcopy(model)
    if make_opt is None:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    else:
        opt = make_opt(model.parameters())
    runner = model
    if engine_cfg is not None:
        runner = hetero.initialize(model, opt, {"chunk_size": 8192, **engine_cfg})
    losses = []
    for i, batch in enumerate(batches):
        loss = loss_of(runner, batch, i)
        if engine_cfg is None:
            loss.backward()
            opt.step()
            opt.zero_grad()
        else:
            runner.backward(loss)
            runner.step()
        losses.append(loss.item())
    state = runner.full_state_dict() if engine_cfg is not None else model.state_dict()
    if engine_cfg is not None:
        runner.close()
    return losses, {k: (v if v.dtype == torch.float64 else v.float()).cpu() for k, v in state.items()}


def _check(model, batches, loss_of, stages=(0, 3), offload="host", make_opt=None, chunk_size=8192):
    refs = _references(model, batches, loss_of, make_opt)
    for stage in stages:
        cfg = {"zero_stage": stage, "offload": {"optimizer": offload, "params": offload if stage == 3 else "device"}}
        cfg["chunk_size"] = chunk_size
        _compare(_train(model, batches, engine_cfg=cfg, loss_of=loss_of, make_opt=make_opt), refs)


def _lm_batches(vocab, n=4, rows=2, seq=10):
    g = torch.Generator().manual_seed(3)
    return [torch.randint(0, vocab, (rows, seq), generator=g) for _ in range(n)]


def _lm_loss(runner, ids, i):
    return runner(input_ids=ids, labels=ids).loss


@pytest.mark.timeout(300)
def test_hf_gpt2():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(
        vocab_size=96, n_positions=32, n_embd=32, n_layer=2, n_head=2, resid_pdrop=0, embd_pdrop=0, attn_pdrop=0
    )
    _check(transformers.GPT2LMHeadModel(cfg), _lm_batches(96), _lm_loss)


# A tiny decoder of the Llama family (vocabulary 96): Llama itself, or Mixtral with `num_local_experts` and so on.
TINY_DECODER = dict(
    vocab_size=96,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
)


def tiny_hf(family: str = "Llama", **extra) -> nn.Module:
    """`transformers.<family>ForCausalLM` of `TINY_DECODER` (and `extra`), built from seed 0."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = getattr(transformers, f"{family}Config")(**TINY_DECODER, **extra)
    return getattr(transformers, f"{family}ForCausalLM")(cfg)


@pytest.mark.timeout(300)
def test_hf_llama():
    _check(tiny_hf(), _lm_batches(96), _lm_loss, stages=(1, 3), offload="host")


@pytest.mark.timeout(300)
def test_hf_bert():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.BertConfig(
        vocab_size=96,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=32,
        hidden_dropout_prob=0,
        attention_probs_dropout_prob=0,
        num_labels=3,
    )
    g = torch.Generator().manual_seed(4)
    batches = [(torch.randint(0, 96, (4, 12), generator=g), torch.randint(0, 3, (4,), generator=g)) for _ in range(4)]

    def loss_of(runner, batch, i):
        ids, labels = batch
        return runner(input_ids=ids, attention_mask=torch.ones_like(ids), labels=labels).loss

    _check(transformers.BertForSequenceClassification(cfg), batches, loss_of, stages=(2, 3))


class SmallCNN(nn.Module):
    """torchvision-style: conv, batch norm (running-stat buffers), residual block, pooling, classifier."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU())
        self.block = nn.Sequential(nn.Conv2d(8, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8))
        self.head = nn.Linear(8, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        x = torch.relu(x + self.block(x))
        return self.head(x.mean(dim=(2, 3)))


def test_cnn_with_batch_norm(monkeypatch):
    # cuDNN convolves fp32 in TF32 by default (a 10-bit mantissa): the engine's run on a GPU would then be compared
    # with the CPU's fp32 references at a tolerance of fp32 rounding (tests/tolerance.py). fp32 it is, as on the CPU.
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(5)
    batches = [(torch.randn(4, 3, 8, 8, generator=g), torch.randint(0, 5, (4,), generator=g)) for _ in range(4)]

    def loss_of(runner, batch, i):
        x, y = batch
        out = runner(x)  # the engine's outputs are on its device (cuda:0 on a GPU machine); the labels follow them
        return nn.functional.cross_entropy(out, y.to(out.device))

    _check(SmallCNN(), batches, loss_of, stages=(0, 2, 3))


class SkipAndReuse(nn.Module):
    """A branch some steps skip, and a layer applied twice in one forward."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(6, 16)
        self.shared = nn.Linear(16, 16)
        self.sometimes = nn.Linear(16, 16)
        self.out = nn.Linear(16, 2)

    def forward(self, x: torch.Tensor, use_branch: bool) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        h = torch.tanh(self.shared(h))
        if use_branch:
            h = torch.tanh(self.sometimes(h))
        h = torch.tanh(self.shared(h))  # the same parameters again, in the same pass
        return self.out(h)


def test_skipped_modules_and_params_used_twice():
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(6)
    batches = [(torch.randn(4, 6, generator=g), torch.randint(0, 2, (4,), generator=g)) for _ in range(8)]

    def loss_of(runner, batch, i):
        x, y = batch
        out = runner(x, use_branch=i % 3 != 1)  # on the engine's device: the labels follow it
        return nn.functional.cross_entropy(out, y.to(out.device))

    # Small chunks, so the skipped branch has a chunk of its own that some steps never gather.
    torch.manual_seed(0)
    refs = _references(SkipAndReuse(), batches, loss_of)
    for stage in (0, 1, 2, 3):
        torch.manual_seed(0)
        cfg = {"zero_stage": stage, "chunk_size": 300}
        _compare(_train(SkipAndReuse(), batches, engine_cfg=cfg, loss_of=loss_of), refs)


class CrossBlock(nn.Module):
    """Blocks (the units of stage 3) whose modules also run outside their own block: block 2 calls block 0's
    second layer, and the model calls block 1's first layer after the blocks, outside any."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(6, 16)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 16)) for _ in range(3))
        self.out = nn.Linear(16, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        for i, block in enumerate(self.blocks):
            h = h + block(h)
            if i == 2:
                h = h + self.blocks[0][2](torch.tanh(h))
        h = torch.tanh(self.blocks[1][0](h))
        return self.out(h)


def _class_batches(seed: int, n: int):
    """n batches of 4 rows of 6 features with a class label each."""
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(4, 6, generator=g), torch.randint(0, 2, (4,), generator=g)) for _ in range(n)]


def _ce(runner, batch, i):
    x, y = batch
    out = runner(x)  # on the engine's device: the labels follow it
    return nn.functional.cross_entropy(out, y.to(out.device))


def _count_unit_hooks(monkeypatch):
    """Count the backward hooks (`_OnBackward` nodes) a step's forward installs."""
    from hetero.zero import hooks

    calls = [0]
    apply = hooks._OnBackward.apply

    def counted(*args):
        calls[0] += 1
        return apply(*args)

    monkeypatch.setattr(hooks._OnBackward, "apply", counted)
    return calls


def _count_forward_pins(monkeypatch):
    """Count the pins in forward (`Gathers.use` outside backward: a unit's or a module's parameters pinned)."""
    from hetero.zero.gathers import Gathers
    from hetero.zero.protocol import in_backward

    calls = [0]
    use = Gathers.use

    def counted(self, entries, unit):
        calls[0] += not in_backward()
        return use(self, entries, unit)

    monkeypatch.setattr(Gathers, "use", counted)
    return calls


@pytest.mark.parametrize("whole", [True, False], ids=["unit-pins-all", "module-pins-own"])
def test_modules_run_outside_their_block(monkeypatch, whole):
    """A unit's backward (and forward) pins all of its parameters where the budget holds it ([Note: one backward hook
    per unit], [Note: one forward hook per unit]), so its modules install no backward hook of their own; a module
    run outside its block keeps one, or its parameters would be released when its backward reads them (an error)."""
    from hetero import engine as engine_module

    rules = engine_module.unit_rules
    monkeypatch.setattr(engine_module, "unit_rules", lambda *a, **k: rules(*a, **k)._replace(whole=whole))
    calls = _count_unit_hooks(monkeypatch)
    pins = _count_forward_pins(monkeypatch)
    torch.manual_seed(0)
    batches = _class_batches(7, 6)
    model = CrossBlock()
    refs = _references(model, batches, _ce)

    def counting(runner, batch, i):
        if i == 1:
            calls[0] = pins[0] = (
                0  # the first step runs with every module's hook (see Gathers.learn): count from the second
            )
        return _ce(runner, batch, i)

    # Chunks of 300 elements: each block's two layers in chunks of their own, released between the blocks.
    _compare(_train(model, batches, engine_cfg={"zero_stage": 3, "chunk_size": 300}, loss_of=counting), refs)
    per_step = calls[0] / (len(batches) - 1)
    # Units: inp, out and the three blocks, each with a hook on its outputs and (but inp, whose input needs no
    # gradient) one on its inputs: 9. The six modules inside the blocks, each once more where it also ran outside its
    # block: with the unit pinning all, only those two calls; else all eight.
    assert per_step == (11 if whole else 17), per_step
    # [Note: one forward hook per unit]: where units pin whole, each unit's forward pins its parameters at once (5
    # units: inp, out, the blocks) and only the two modules run outside their block pin their own; else each of the
    # eight modules with parameters pins its own, and the two run outside their block again.
    assert pins[0] / (len(batches) - 1) == (7 if whole else 10), pins[0]


class _SideBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.main = nn.Linear(6, 6)
        self.side = nn.Linear(6, 6)
        self.kept: torch.Tensor | None = None

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        self.kept = self.side(h)  # kept aside, not among the block's outputs
        return torch.tanh(self.main(h))


class SideOutput(nn.Module):
    """Block 0's output is left unused, but an output of one of its layers, which it kept aside, reaches the loss:
    that layer's backward runs while block 0's backward never starts (autograd runs nodes in reverse order of
    creation, so a kept-aside output used by a later block would not do: the block's own backward comes first)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(6, 6)
        self.blocks = nn.ModuleList(_SideBlock() for _ in range(3))
        self.out = nn.Linear(6, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x))  # an input that needs a gradient: the kept-aside layer's backward reads its weight
        self.blocks[0](h)  # its output unused: only what it kept aside reaches the loss
        h = self.blocks[2](self.blocks[1](h))
        return self.out(h + self.blocks[0].kept)


def test_an_output_kept_aside_past_its_unit():
    """The first backward finds a module's backward outside its unit's, so units never pin whole (each module keeps
    its backward hook), and the model trains as plain PyTorch does."""
    torch.manual_seed(0)
    model, batches = SideOutput(), _class_batches(8, 5)
    refs = _references(model, batches, _ce)
    _compare(_train(model, batches, engine_cfg={"zero_stage": 3, "chunk_size": 64}, loss_of=_ce), refs)
    engine = hetero.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), {"zero_stage": 3, "chunk_size": 64})
    for i, batch in enumerate(batches[:2]):
        engine.backward(_ce(engine, batch, i))
        engine.step()
    assert engine.gathers.whole is False
    engine.close()


def test_whole_units_from_the_start_fail_on_an_output_kept_aside():
    """Why the first backward looks first: pinning whole units from the start leaves the kept-aside layer's chunk
    released when its backward comes."""
    torch.manual_seed(0)
    model, batches = SideOutput(), _class_batches(8, 5)
    # Gathering ahead would gather that chunk again as the unit after it starts its backward, here: not in general.
    config = {"zero_stage": 3, "chunk_size": 64, "gather_ahead": False}
    engine = hetero.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), config)
    engine.gathers.whole = True
    with pytest.raises(RuntimeError):
        engine.backward(_ce(engine, batches[0], 0))
    engine.close()


def test_units_pin_whole_from_the_second_backward():
    """Where nothing escapes its unit, the second backward on pins whole units."""
    model = CrossBlock()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    engine = hetero.initialize(model, opt, {"zero_stage": 3, "chunk_size": 300})
    x, y = torch.randn(4, 6), torch.randint(0, 2, (4,))
    whole = []
    for _ in range(2):
        out = engine(x)
        whole.append(engine.gathers.whole)
        engine.backward(nn.functional.cross_entropy(out, y.to(out.device)))
        engine.step()
    engine.close()
    assert whole == [False, True]


def test_train_batch_learns_whole_units_too():
    """`train_batch` over micro-batches (no pipeline) decides after its first backward as well."""
    torch.manual_seed(0)
    model = CrossBlock()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    cfg = {"zero_stage": 3, "chunk_size": 300, "parallel": {"microbatches": 2}}
    engine = hetero.initialize(model, opt, cfg)
    x, y = torch.randn(4, 6), torch.randint(0, 2, (4,))
    whole = []
    for _ in range(2):
        whole.append(engine.gathers.whole)
        engine.train_batch(x, y, loss_fn=nn.functional.cross_entropy)
    engine.close()
    assert whole == [False, True]


class _BagOfWords(nn.Module):
    """A sparse embedding (its gradient a sparse tensor: the rows a batch looked up) under a dense classifier."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(50, 16, sparse=True)
        self.head = nn.Linear(16, 3)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(ids).mean(1))


@pytest.mark.parametrize(
    "make_opt",
    [
        lambda params: torch.optim.SGD(params, lr=0.5, momentum=0.9),
        lambda params: torch.optim.Adagrad(params, lr=0.1),
    ],
    ids=["sgd-momentum", "adagrad"],
)
def test_sparse_embedding_gradients(make_opt):
    # Chunks sum dense gradients: a sparse one is made dense (zeros in the rows not looked up), which is the update
    # torch's SGD (momentum included) and Adagrad make from it. Before, "reshape is not implemented for sparse
    # tensors" came from inside hetero.
    torch.manual_seed(0)
    model = _BagOfWords()
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randint(0, 50, (4, 6), generator=g), torch.randint(0, 3, (4,), generator=g)) for _ in range(5)]

    def loss_of(m, batch, i):
        out = m(batch[0])  # on the engine's device (cuda:0 on a GPU machine): the labels follow it
        return nn.functional.cross_entropy(out, batch[1].to(out.device))

    _check(model, batches, loss_of, offload="device", make_opt=make_opt)


class _Reparametrized(nn.Module):
    """Weights recomputed by forward pre-hooks that torch's utilities register on the layers: pruning's mask
    (`weight_orig * weight_mask`), the legacy weight_norm (`weight_g`, `weight_v`), spectral_norm (`weight_orig`),
    and a user's pre-hook scaling a layer's input by a norm of its weight; in blocks and at the top level."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(20, 16)
        self.blocks = nn.ModuleList(nn.Linear(16, 16) for _ in range(4))
        self.head = nn.Linear(16, 20)
        torch.nn.utils.prune.l1_unstructured(self.blocks[0], "weight", amount=0.3)
        torch.nn.utils.weight_norm(self.blocks[1])
        torch.nn.utils.spectral_norm(self.blocks[2])
        self.blocks[3].register_forward_pre_hook(lambda m, args: (args[0] * torch.tanh(m.weight.norm()),))
        torch.nn.utils.prune.random_unstructured(self.head, "weight", amount=0.2)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        for block in self.blocks:
            h = h + torch.tanh(block(h))
        return self.head(h)

    def __deepcopy__(self, memo: dict) -> _Reparametrized:
        # The recomputed weights are not leaves, which deepcopy refuses: a copy is a new model with these values.
        copied = _Reparametrized()
        copied.load_state_dict(self.state_dict())
        return copied


def test_weights_recomputed_by_pre_hooks():
    # hetero's pre-hook gathers a module's parameters first among its pre-hooks: those registered before
    # initialize (pruning, weight_norm, spectral_norm, the user's) read them. Before, at stage 3 each of them raised
    # ReleasedParameterError, their hooks running before hetero's.
    import torch.nn.utils.prune  # noqa: F401  (not imported by torch.nn.utils itself)

    torch.manual_seed(0)
    model = _Reparametrized()
    batches = _lm_batches(20, n=4, rows=2, seq=6)

    def loss_of(m, ids, i):
        out = m(ids)  # on the engine's device: the labels follow it
        return nn.functional.cross_entropy(out.flatten(0, 1), ids.to(out.device).flatten())

    # Small chunks: each block's layer in a chunk of its own, released between the blocks.
    refs = _references(model, batches, loss_of)
    for stage in (2, 3):
        cfg = {"zero_stage": stage, "chunk_size": 400}
        _compare(_train(model, batches, engine_cfg=cfg, loss_of=loss_of), refs)


class _ScaledBy(torch.autograd.Function):
    """y = x * w.sum(), whose backward reads the weight it kept in ctx (not saved for backward), as hand-written
    kernels' Functions often do."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x)
        ctx.w = w
        return x * w.sum()

    @staticmethod
    def backward(ctx, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        (x,) = ctx.saved_tensors
        return g * ctx.w.sum(), (g * x).sum() * torch.ones_like(ctx.w)


class _ReadsOthersWeights(nn.Module):
    """Weights read outside their modules' forwards: the head tied to the embedding as `h @ embed.weight.t()` (a view
    of the weight), the input looked up in an unused table's weight by F.embedding, a slice of a block's weight in the
    model's own arithmetic, a block's forward hook reading another block's weight, and a custom Function reading a
    weight again in its backward."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(20, 16)
        self.table = nn.Embedding(20, 16)  # never called: looked up by F.embedding in the model's forward
        self.blocks = nn.ModuleList(nn.Linear(16, 16) for _ in range(3))
        self.scale = nn.Linear(4, 4, bias=False)  # never called: read by _ScaledBy, forward and backward
        self.norm = nn.LayerNorm(16)
        object.__setattr__(self.blocks[0], "peer", self.blocks[2])  # a reference, not a submodule
        self.blocks[0].register_forward_hook(
            lambda m, args, out: out + 0.1 * nn.functional.linear(args[0], m.peer.weight)
        )

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids) + nn.functional.embedding(ids, self.table.weight)
        for block in self.blocks:
            h = h + torch.tanh(block(h))
        h = h + h[..., :4].sum(-1, keepdim=True) * self.blocks[1].weight[:4, 0].sum()
        h = _ScaledBy.apply(h, self.scale.weight)
        return self.norm(h) @ self.embed.weight.t()


def _tied_loss(m, ids, i):
    out = m(ids)  # on the engine's device: the labels follow it
    if i == 1:
        with torch.no_grad():
            m(ids)  # an evaluation forward between a training forward and its backward
    return nn.functional.cross_entropy(out.flatten(0, 1), ids.to(out.device).flatten())


def test_weights_read_outside_their_modules():
    # [Note: a parameter read outside its module] in hetero/zero/hooks.py: each such read is a call of the weight's
    # module outside its unit. Before, each raised ReleasedParameterError at stage 3.
    torch.manual_seed(0)
    model = _ReadsOthersWeights()
    # Chunks of 400 elements: the embeddings, each block, the head's weight in chunks of their own, released between.
    _check(model, _lm_batches(20, n=4, rows=2, seq=6), _tied_loss, stages=(0, 3), chunk_size=400)


def test_weights_read_outside_the_forward_or_written_stay_errors():
    from hetero.errors import ReleasedParameterError

    torch.manual_seed(0)
    model = _ReadsOthersWeights()
    engine = hetero.initialize(model, torch.optim.AdamW(model.parameters()), {"zero_stage": 3, "chunk_size": 400})
    try:
        with pytest.raises(ReleasedParameterError, match="gathered_parameters"):
            model.embed.weight.norm()  # outside the model's forward: one rank's read would gather alone
        model.blocks[1].register_forward_hook(lambda m, a, out: model.blocks[2].weight.mul_(1.0))
        with pytest.raises(ReleasedParameterError, match="blocks.2.weight"), torch.no_grad():
            engine(torch.zeros(1, 3, dtype=torch.long))  # a write into a released weight: not a read to gather
    finally:
        engine.close()


def _tied_rank(rank: int, world: int, batches: list[torch.Tensor]) -> tuple[list[float], dict[str, torch.Tensor]]:
    """_ReadsOthersWeights at stage 3 on this rank's rows of each batch (every rank the same number)."""
    torch.set_num_threads(1)
    torch.manual_seed(0)
    rows = batches[0].shape[0] // world
    mine = [b[rank * rows : (rank + 1) * rows] for b in batches]
    return _train(_ReadsOthersWeights(), mine, engine_cfg={"zero_stage": 3, "chunk_size": 400}, loss_of=_tied_loss)


@ranks_apart(OWN_BATCHES)
@pytest.mark.timeout(300)
def test_weights_read_outside_their_modules_over_two_ranks():
    # The reads' gathers fall at the same point of every rank's program, and a chunk read by the model's own
    # arithmetic is reduced once every rank's backward through it is done: the mean of the ranks' losses and the
    # weights are the full batch's.
    torch.manual_seed(0)
    batches = _lm_batches(20, n=4, rows=4, seq=6)
    refs = _references(_ReadsOthersWeights(), batches, _tied_loss)
    ranks = run_distributed(_tied_rank, 2, batches, timeout=200)
    losses = [sum(r[0][i] for r in ranks) / 2 for i in range(len(batches))]
    for _, state in ranks:
        _compare((losses, state), refs)


@dataclasses.dataclass
class _GatedOut:
    h: torch.Tensor
    gate: torch.Tensor | None = dataclasses.field(init=False, default=None)  # set after construction
    skip: torch.Tensor | None = None


class _GatedBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.value = nn.Linear(6, 6)
        self.gate = nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> _GatedOut:
        out = _GatedOut(h=torch.tanh(self.value(x)), skip=x)
        out.gate = torch.sigmoid(self.gate(x))
        return out


class _Gated(nn.Module):
    """Blocks returning a dataclass with a field outside its constructor (init=False), set by the block."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_GatedBlock() for _ in range(2))
        self.out = nn.Linear(6, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            o = block(x)
            x = o.h * o.gate + o.skip
        return self.out(x)


def test_a_dataclass_output_keeps_its_fields_outside_the_constructor():
    # Stage 3 passes a unit's outputs through its backward hook and rebuilt a dataclass with dataclasses.replace,
    # which takes only the constructor's fields: the block's gate came back None (a TypeError in the model's forward).
    torch.manual_seed(0)
    _check(_Gated(), _class_batches(9, 3), _ce, stages=(3,), chunk_size=300)
