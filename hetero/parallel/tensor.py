"""1D tensor parallelism (Megatron style), applied in place from a plan: names and ``state_dict()`` keys unchanged.

``apply_tensor_parallel(model, plan, comm)`` takes a complete model, identical on every rank of ``comm`` (the tensor
group), and replaces each planned parameter's data by this rank's shard (a contiguous copy), recording how it was
cut as ``param._hetero_tp`` (:class:`TPShard`). A module's forward changes by swapping its class for a subclass
that adds the communication (FSDP2 does the same), so hooks, names and the module tree stay as they were.

Invariants the engine relies on: a parameter without ``_hetero_tp`` is replicated over the tensor group and its
gradient is complete and identical on every tensor rank when backward ends (under sequence parallelism a hook sums
the parts, see ``sequence.py``). The global gradient norm is therefore the sum over tensor ranks of (sharded
parameters' squares + replicated parameters' squares / degree). A key/value head that several tensor ranks hold
whole (fewer key/value heads than ranks, kv_replicas.py) is a shard those ranks hold alike: its cut's `replicas`
counts them, and its gradient is summed over them in backward.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from hetero.comm import Comm
from hetero.errors import ConfigError
from hetero.parallel.fused_qkv import qkv_blocks
from hetero.parallel.kv_replicas import ReplicaGroups, head_counts, kv_layout, kv_projections, shard_kv_projection
from hetero.parallel.plan_checks import check_styles_given
from hetero.parallel.plans import COLUMN, FUSED_PARTS, resolve_plan
from hetero.parallel.replicas import check_replicas
from hetero.parallel.sequence import (
    add_sequence_gather,
    add_sequence_scatter,
    all_reduce_grads,
    replace_first_input,
)
from hetero.parallel.tp_ops import copy_to_region, gather_seq, reduce_from_region, reduce_scatter_seq
from hetero.parallel.tp_rng import RegionRng
from hetero.parallel.tp_shard import TPShard, check_divides, shard_of, unshard  # noqa: F401 (unshard: imported from here)
from hetero.parallel.vocab import AlignedLMLoss, CausalLMLoss, embed_vocab_parallel, local_padding_idx

log = logging.getLogger("hetero.parallel")
Blocks = tuple[int, ...] | None  # a fused layer's unequal block widths (TPShard.sizes)


def _shard(param: nn.Parameter, dim: int, parts: int, comm: Comm, what: str, sizes: Blocks = None) -> None:
    """Replace ``param.data`` by this rank's shard, once (a tied parameter is met twice)."""
    done = getattr(param, "_hetero_tp", None)
    if done is not None:
        if (done.dim, done.parts, done.sizes) != (dim, parts, sizes):
            first = getattr(param, "_hetero_tp_name", "another module's parameter")
            raise ConfigError(
                f"{what} is the same parameter as {first} (tied), and the plan cuts them differently: {first} "
                f"{_cut_words(done.dim, done.parts)}, {what} {_cut_words(dim, parts)}. A tied parameter has one "
                "shard per rank: give both modules' plan lines the same style (an input embedding tied to the LM "
                "head: 'vocab' with 'vocab_head'), or untie them before apply_tensor_parallel"
            )
        return
    check_divides(param, dim, parts, comm.size, what, sizes)
    info = TPShard(dim=dim, parts=parts, degree=comm.size, rank=comm.rank, full_shape=tuple(param.shape), sizes=sizes)
    with torch.no_grad():
        param.data = shard_of(param.data, info).contiguous().clone()
    param.grad = None  # a gradient of the full shape would no longer fit
    param._hetero_tp = info
    param._hetero_tp_name = what  # a tied module met later names it in its refusal


def _cut_words(dim: int, parts: int) -> str:
    """How a cut splits a parameter, in words for a refusal."""
    return f"along dimension {dim}" + (f", each of its {parts} blocks on its own" if parts > 1 else "")


class _Region:
    """The tensor group of one ``apply_tensor_parallel`` call and how inputs enter its tensor-parallel region."""

    def __init__(self, comm: Comm, sequence: bool) -> None:
        self.comm = comm
        self.sequence = sequence  # Megatron-SP: column-parallel inputs arrive sharded along the sequence
        self.rng = RegionRng(comm)  # this rank's stream inside the region ([Note: dropout under tensor parallelism])
        self.kv: dict[str, Any] = {}  # key/value projections holding whole heads replicated over ranks -> KVReplicas
        self.kv_groups = ReplicaGroups(comm)  # the ranks that share a key/value head, by replica count
        self.blocks: dict[str, tuple[int, ...]] = {}  # fused q/k/v layers of unequal blocks -> their widths

    def enter(self, x: torch.Tensor, *, sequence: bool, head: bool = False) -> torch.Tensor:
        """f (or the all-gather along the sequence under SP), unless a parent module brought ``x`` in already:
        q, k and v (or gate and up) projections read the same input, and one collective must serve them all.
        Without SP the region's random stream begins here (not at the head: no row-parallel layer follows it)."""
        if getattr(x, "_hetero_tp_entered", None) is self:
            return x
        if not (head or self.sequence):
            self.rng.enter_at(x)
        y = gather_seq(x, self.comm) if sequence else copy_to_region(x, self.comm)
        y._hetero_tp_entered = self  # marks this tensor object only: any op on it makes an unmarked tensor
        return y


def _conv1d(module: nn.Module) -> bool:
    """Hugging Face's Conv1D: a linear layer whose weight is stored [in, out]."""
    return hasattr(module, "nf") and hasattr(module, "nx") and not isinstance(module, nn.Linear)


class _Colwise:
    def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        region = self._hetero_region
        return super().forward(region.enter(x, sequence=region.sequence), *args, **kwargs)


class LogitsHead:
    """A language-model head whose logits are cut over ranks (1D: by vocabulary; a grid: by rows and vocabulary);
    `whole_logits` gathers them whole on every rank, which is what `generate` picks tokens from."""

    def whole_logits(self, logits: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


class _VocabHead(LogitsHead):
    def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        # The head sits after sequence_gather: its input is the whole sequence, replicated, under SP too.
        return super().forward(self._hetero_region.enter(x, sequence=False, head=True), *args, **kwargs)

    def whole_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """This rank's part of the vocabulary gathered with the other tensor ranks' into whole logits."""
        return self._hetero_region.comm.all_gather_dim(logits, logits.dim() - 1)


def _whole_logits_hook(module: nn.Module, args: tuple, out: torch.Tensor) -> torch.Tensor:
    return module.whole_logits(out)


def _generating_class(cls: type) -> type:
    """`cls` whose Hugging Face `generate` sees whole logits: it picks the next token by an argmax or a sample over
    the vocabulary, and over one rank's part each rank would pick another token, by its index in the part, with no
    error. Same name (save_pretrained writes it as the architecture) and signature (`synced_gpus`, read by
    hetero/zero/generate.py); the head gathers only inside generate, so training and a plain forward keep their
    logits cut (the vocabulary-parallel loss takes them so)."""
    base = cls.generate

    @functools.wraps(base)
    def generate(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        handles = [m.register_forward_hook(_whole_logits_hook) for m in self.modules() if isinstance(m, LogitsHead)]
        try:
            return base(self, *args, **kwargs)
        finally:
            for h in handles:
                h.remove()

    return type(cls.__name__, (cls,), {"generate": generate, "__module__": cls.__module__, "_hetero_whole": True})


def generate_with_whole_logits(model: nn.Module) -> None:
    """Swap `model`'s class for its generating one (once per class) when it has a generate to wrap: its heads'
    logits (`LogitsHead`) are gathered whole inside `generate` only."""
    cls = type(model)
    if not callable(getattr(cls, "generate", None)) or cls.__dict__.get("_hetero_whole"):
        return
    if (_GenerateWhole, cls) not in _SUBCLASSES:
        _SUBCLASSES[(_GenerateWhole, cls)] = _generating_class(cls)
    model.__class__ = _SUBCLASSES[(_GenerateWhole, cls)]


class _GenerateWhole:
    """The key of a generating class in _SUBCLASSES."""


def is_vocab_head(module: nn.Module) -> bool:
    """Whether `module` is a vocabulary-parallel head: its outputs are this rank's part of the vocabulary."""
    return isinstance(module, _VocabHead)


class _Rowwise:
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        region = self._hetero_region
        if not region.sequence:
            region.rng.leave()  # the sum below is replicated: what follows draws the shared stream
        y = torch.matmul(x, self.weight) if _conv1d(self) else F.linear(x, self.weight)
        y = reduce_scatter_seq(y, region.comm) if region.sequence else reduce_from_region(y, region.comm)
        # The bias is added once, after the sum (added on every rank before it, it would count degree times).
        return y if self.bias is None else y + self.bias


class _VocabEmbedding:
    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        # The class's own forward on this rank's rows (Gemma's embedding scales its output by sqrt(hidden)).
        return embed_vocab_parallel(ids, self.num_embeddings, self._hetero_region.comm, super().forward)


_SUBCLASSES: dict[tuple[type, type], type] = {}  # (mixin, module class) -> the class swapped in


def _swap_class(module: nn.Module, mixin: type, region: _Region, name: str) -> None:
    if getattr(module, "_hetero_region", None) is not None:
        raise ConfigError(f"{name} is tensor-parallel already: apply a plan once, with one style per layer")
    cls = type(module)
    key = (mixin, cls)
    if key not in _SUBCLASSES:
        label = mixin.__name__.strip("_")
        _SUBCLASSES[key] = type(f"{label}{cls.__name__}", (mixin, cls), {"__module__": __name__})
    module.__class__ = _SUBCLASSES[key]
    module._hetero_region = region


def linear_dims(module: nn.Module, name: str, style: str) -> tuple[int, int]:
    """(output-feature dim, input-feature dim) of a Linear or Conv1D weight."""
    if isinstance(module, nn.Linear):
        return 0, 1
    if _conv1d(module):
        return 1, 0
    raise ConfigError(f"{name} is a {type(module).__name__}: style {style!r} needs an nn.Linear or a Conv1D")


def _check(part: str, module: nn.Module, name: str, degree: int, sizes: Blocks = None) -> None:
    """Raise before anything changes if a style cannot apply to a module at this degree."""
    what = f"{name} ({part})"
    if part in (*COLUMN, "rowwise"):
        out_dim, in_dim = linear_dims(module, name, part)
        parts = FUSED_PARTS.get(part, 1)
        check_divides(module.weight, in_dim if part == "rowwise" else out_dim, parts, degree, what, sizes)
    elif part in ("vocab", "vocab_head"):
        kind = nn.Embedding if part == "vocab" else nn.Linear
        if not isinstance(module, kind):
            raise ConfigError(f"{name} is a {type(module).__name__}: style {part!r} needs an {kind.__name__}")
        check_divides(module.weight, 0, 1, degree, what)
    elif part == "heads" and kv_layout(module, name, degree) is None:  # replicated key/value heads: kv_replicas.py
        head_counts(module, name, degree)


_SHARDED_INSIDE = (*COLUMN, "rowwise", "head_norm")  # styles that handle a parameter between f and g


def _check_inside(resolved: Mapping[str, str], modules: Mapping[str, nn.Module]) -> None:
    """Raise if a module holding parameters inside an attention or MLP region (``heads``, ``parallel_input``) has no
    style for them: there each rank computes only its heads or features, so a whole parameter left alone would get
    a part of its gradient (Qwen3's q_norm did before its plan named it), and ranks would drift apart silently."""
    for outer, style in resolved.items():
        if not {"heads", "parallel_input"} & set(style.split("+")):
            continue
        for sub, module in modules[outer].named_modules():
            name = f"{outer}.{sub}" if sub else outer
            own = [n for n, _ in module.named_parameters(recurse=False)]
            if own and not set(resolved.get(name, "").split("+")) & set(_SHARDED_INSIDE):
                raise ConfigError(
                    f"{name} ({type(module).__name__}) holds parameters {own} inside {outer} (style {style!r}), where "
                    "each tensor rank computes only its own heads or features, and the plan gives it no style for "
                    f"them: shard it ('colwise', 'rowwise'), or give a norm applied to each head 'head_norm'"
                )


def _apply(part: str, module: nn.Module, name: str, region: _Region) -> None:
    comm, degree = region.comm, region.comm.size
    if part in (*COLUMN, "vocab_head"):
        out_dim, _ = (0, 1) if part == "vocab_head" else linear_dims(module, name, part)
        parts = FUSED_PARTS.get(part, 1)
        if name in region.kv:  # [Note: key/value heads replicated over tensor ranks]
            shard_kv_projection(module, name, out_dim, region.kv[name], region.kv_groups)
        else:
            sizes = region.blocks.get(name)  # [Note: fused q/k/v projections]: q, k and v each cut by heads
            _shard(module.weight, out_dim, parts, comm, f"{name}.weight", sizes)
            if getattr(module, "bias", None) is not None:
                _shard(module.bias, 0, parts, comm, f"{name}.bias", sizes)
        _swap_class(module, _VocabHead if part == "vocab_head" else _Colwise, region, name)
        _set_features(module, out=module.weight.shape[out_dim])
    elif part == "rowwise":
        _, in_dim = linear_dims(module, name, part)
        _shard(module.weight, in_dim, 1, comm, f"{name}.weight")
        if region.sequence and module.bias is not None:
            all_reduce_grads([module.bias], comm)  # added to this rank's part of the sequence only
        _swap_class(module, _Rowwise, region, name)
        _set_features(module, inp=module.weight.shape[in_dim])
    elif part == "vocab":
        _shard(module.weight, 0, 1, comm, f"{name}.weight")
        _swap_class(module, _VocabEmbedding, region, name)
        module.num_embeddings = module.weight.shape[0]
        # The layer's own forward looks up this rank's rows: its padding row is a row of the shard, if any.
        module._hetero_padding_idx = module.padding_idx  # the whole table's, for lazy_init's replay
        module.padding_idx = local_padding_idx(module.padding_idx, module.num_embeddings, comm.rank)
    elif part == "heads":
        layout = kv_layout(module, name, degree)
        for attr, value in (layout.local_counts(module) if layout else head_counts(module, name, degree)).items():
            setattr(module, attr, value)
        _apply("parallel_input", module, name, region)  # attention reads the sequence length from its input
    elif part == "parallel_input":

        def pre_hook(_: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
            return replace_first_input(name, args, kwargs, lambda x: region.enter(x, sequence=region.sequence))

        module.register_forward_pre_hook(pre_hook, with_kwargs=True)
        if not region.sequence:  # the region ends inside (at the row-parallel layer); at the latest, here
            module.register_forward_hook(region.rng.leave, always_call=True)
    elif part == "norm":
        if region.sequence:
            all_reduce_grads(list(module.parameters()), comm)
    elif part == "head_norm":  # fed this rank's heads only, under SP too (attention's input is gathered)
        all_reduce_grads(list(module.parameters()), comm)
    elif part == "sequence_scatter" and region.sequence:
        add_sequence_scatter(module, name, comm)
        enter = functools.partial(replace_first_input, name, fn=region.rng.enter_at)  # after the scatter: own positions
        module.register_forward_pre_hook(lambda _, args, kwargs: enter(args, kwargs), with_kwargs=True)
    elif part == "sequence_gather" and region.sequence:
        add_sequence_gather(module, name, comm)
        module.register_forward_hook(region.rng.leave, always_call=True)


def _set_features(module: nn.Module, *, out: int | None = None, inp: int | None = None) -> None:
    """Keep the layer's size attributes true to its local weight (Conv1D's forward shapes its output with nf)."""
    names = ("nf", "nx") if _conv1d(module) else ("out_features", "in_features")
    if out is not None:
        setattr(module, names[0], out)
    if inp is not None:
        setattr(module, names[1], inp)


def _install_loss(model: nn.Module, comm: Comm) -> None:
    """Make ``model(inputs, labels=...).loss`` the vocabulary-parallel cross entropy of the sharded logits."""
    if isinstance(getattr(type(model), "loss_function", None), property):
        # transformers' PreTrainedModel: the property has a setter, per instance; it shifts the labels itself.
        model.loss_function = CausalLMLoss(comm)
    elif callable(getattr(model, "loss_function", None)):
        # A loss_function method (hetero's GPT): called with labels already aligned to the logits.
        model.loss_function = AlignedLMLoss(comm)
    elif heads := [m for m in model.modules() if callable(getattr(m, "loss_function", None)) and _sharded_head(m)]:
        # A pipelined GPT computes its loss in its last unit, the one holding the sharded head.
        for m in heads:
            m.loss_function = AlignedLMLoss(comm)
    else:
        log.warning(
            "%s has no loss_function to replace: its logits are sharded by vocabulary, so compute the loss with "
            "hetero.parallel.vocab_parallel_cross_entropy",
            type(model).__name__,
        )


def _sharded_head(module: nn.Module) -> bool:
    head = getattr(module, "lm_head", None)
    return head is not None and is_vocab_head(head)


def check_untouched(model: nn.Module) -> None:
    """Raise if tensor or sequence parallelism was applied to ``model`` already (twice would cut shards again)."""
    for name, p in model.named_parameters():
        if hasattr(p, "_hetero_tp") or getattr(p, "_hetero_sp_reduced", False):
            raise ConfigError(
                f"{name} is sharded or sequence-parallel already: apply tensor or sequence parallelism once per "
                "model, to the complete model"
            )


def check_tensor_plan(
    model: nn.Module, plan: Mapping[str, str] | str, degree: int, *, sequence: bool = False, strict: bool = True
) -> dict[str, str]:
    """Raise the ConfigError `apply_tensor_parallel` would raise on ``model`` at ``degree``, changing nothing; returns
    the resolved plan. Run on the whole model before a pipeline cuts it: each stage would otherwise check only its own
    layers, and a stage whose layers pass would go on to wait for one that raised."""
    resolved = resolve_plan(model, plan, strict=strict)
    modules = dict(model.named_modules())
    kv = kv_projections(resolved, modules, degree)  # replicated key/value heads: the layers that hold them
    check_styles_given(resolved, modules, sequence=sequence, degree=degree)  # [Note: styles a plan cannot leave out]
    blocks = qkv_blocks(resolved, modules)
    for name, style in resolved.items():
        for part in style.split("+"):
            if not (part == "colwise" and name in kv):  # a whole head each: no divisibility by the degree
                _check(part, modules[name], name, degree, blocks.get(name))
    _check_inside(resolved, modules)
    styles = {part for style in resolved.values() for part in style.split("+")}
    if missing := [s for s in ("sequence_scatter", "sequence_gather") if sequence and strict and s not in styles]:
        # Without both the region is never entered or never left: the model returned t times the sequence's logits
        # (or 1/t of them), and a loss failed on shapes deep inside the forward.
        raise ConfigError(
            f"sequence parallelism (Megatron) needs a plan with a {' and a '.join(map(repr, missing))} module, where "
            "the sequence is cut (the module the layers begin at: an embedding's dropout, a first decoder layer) and "
            "gathered again (the final norm); this plan has none: add them, or turn sequence parallelism off"
        )
    return resolved


def apply_tensor_parallel(
    model: nn.Module,
    plan: Mapping[str, str] | str,
    comm: Comm,
    *,
    sequence: bool = False,
    strict: bool = True,
    replicas_checked: bool = False,
) -> RegionRng:
    """Shard ``model`` in place over the tensor group ``comm`` following ``plan`` (patterns -> styles, or "auto").

    The model must be complete and identical on every rank of ``comm`` (checked). Every check runs before anything
    changes, so a ConfigError leaves the model as it was. ``sequence``: Megatron sequence parallelism as well.
    ``strict``: False lets patterns match nothing (a pipeline stage holding part of the model, whose plan need not
    bound a sequence-parallel region; better: apply to the whole model before splitting it, so the stages' boundaries
    keep the sequence split consistent). ``replicas_checked``: the caller has run `check_replicas` (setup.py: the
    whole model, before the cut). Returns the group's random streams (tp_rng.py; a pipeline stage brackets its units).
    """
    check_untouched(model)
    resolved = check_tensor_plan(model, plan, comm.size, sequence=sequence, strict=strict)
    modules = dict(model.named_modules())
    if not replicas_checked:
        check_replicas(model, comm)
    region = _Region(comm, sequence)
    region.kv = kv_projections(resolved, modules, comm.size)
    region.blocks = qkv_blocks(resolved, modules)  # read before `heads` changes the attentions' counts
    for name, style in resolved.items():
        for part in style.split("+"):
            _apply(part, modules[name], name, region)
    model.register_forward_pre_hook(region.rng.leave)  # a forward that raised inside the region left its stream on
    if any("vocab_head" in style.split("+") for style in resolved.values()):
        _install_loss(model, comm)
        generate_with_whole_logits(model)
    log.info(
        "tensor parallel over %d ranks%s: %d modules planned", comm.size, " with SP" if sequence else "", len(resolved)
    )
    return region.rng
