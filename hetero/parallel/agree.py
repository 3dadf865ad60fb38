"""The batch a tensor- or sequence-parallel group computes on, agreed by its ranks before any of them runs a layer.

[Note: a batch agreed over the model-parallel group]
Every rank of a tensor-parallel group (1D, Megatron-SP, the grid modes) runs the same model on the same batch, and
every rank of a Ulysses or ring sequence group reads the same samples and keeps its part of their positions
(`Mesh.batch_rank`). Their collectives move activations whose shapes follow from the batch's: one rank fed another
batch (a loader sharded by global rank instead of data-parallel rank, a last partial batch on one rank, another
sequence length) calls `all_gather_dim` / `reduce_scatter_dim` / `all_to_all_dim` with other sizes than its peers,
which gloo answers by aborting the process ("Received data size doesn't match expected size") and NCCL by a hang or
silent garbage; other samples of the same shapes train on garbage without a sign. So every entry of a batch
(`engine(...)`, `train_batch`, `eval_batch`; a forward inside the last two is covered by their check) first agrees
on it over the control group ([Note: data and control groups]) of `Mesh.batch_group`, every rank given that batch:
the tensor or sequence group, and with a pipeline those of every stage, each stage's ranks compared among themselves
(a later stage may be given no inputs), so that a mismatch on one stage stops the others too, which would otherwise wait
for its activations until `comm_timeout`. One all-gather of three int64 numbers per rank: a digest of the batch's
structure (every leaf's place in the nested arguments; a tensor's dtype and shape, another leaf's short value), while
`check_collectives` is on a CRC-32 of its tensors' bytes (exact: bit-identical batches agree whatever device holds them;
a device tensor is copied to the host for it), and under a sequence split (Megatron-SP, Ulysses, ring) the length of a
[batch, sequence] token tensor that does not divide into the split's parts (`Mesh.sequence_parts`), else 0: with a
pipeline only the stage holding the scatter would find it, and the stages after it would wait for its activations until
`comm_timeout`, so any rank's length stops every rank with the same ConfigError. Equal rows: the batch goes on.
Otherwise every rank holds every row, so every rank raises the same `BatchMismatchError`, after one object gather of
each rank's description (safe: each just saw the same mismatch), so that the message names each rank's shapes. Nothing
has run yet: the engine is as it was, and a next batch that agrees trains.

Why a blocking gather of its own and not a row in the collective schedule's posted checks ([Note: checks posted,
verified at the wait]): those run over ZeRO's group, which holds no tensor-parallel peer (and under Ulysses / ring
holds other batches' ranks, whose shapes may differ), may be off, and are verified at the wait of a collective
issued after them, when a mismatched collective is already out (gloo aborts at the issue). The price is one small
control-group exchange, a rendezvous of the group's host threads, per entry; measured by
`benchmarks/batch_agreement.py` on two gloo CPU ranks of a loaded 2-core VM, about 0.7-1 ms a check, of which the
bare all-gather of two int64 takes 0.4-0.8 ms (any control message costs that there) and the CRC of a [8, 512]
int64 batch with its labels 0.03-0.05 ms: 0.2% of the small tensor-parallel GPT's 430 ms `train_batch`, whose
median step over interleaved rounds with and without the check was the same (ratio 0.998). Groups of one rank skip
it.
"""

from __future__ import annotations

import contextlib
import hashlib
import zlib
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

import torch

from hetero.comm import Comm
from hetero.errors import BatchMismatchError, ConfigError

if TYPE_CHECKING:
    from hetero.parallel.mesh import Mesh

_ROW = 3  # structure digest, value checksum, a sequence length the split cannot cut (0: none)


def _digest(text: str) -> int:
    """A signed 64-bit digest of `text`, the same in every process (Python's `hash` of a str is salted per run)."""
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little", signed=True)


def leaves(obj: Any, path: str) -> Iterator[tuple[str, Any]]:
    """(place, leaf) of a nested batch: tensors, and whatever else is not a tuple, list or mapping."""
    if isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from leaves(v, f"{path}[{i}]")
    elif isinstance(obj, Mapping):
        for k in sorted(obj, key=str):  # keyword arguments: their order does not matter
            yield from leaves(obj[k], f"{path}[{k!r}]" if path else str(k))
    else:
        yield path or "batch", obj


def describe(batch: Any) -> list[str]:
    """One line per leaf: a tensor's place, dtype and shape; another leaf's type and (short) value."""
    out = []
    for place, v in leaves(batch, ""):
        if isinstance(v, torch.Tensor):
            out.append(f"{place}: {v.dtype} {tuple(v.shape)}")
        else:
            shown = repr(v) if isinstance(v, (bool, int, float, str, type(None))) else type(v).__name__
            out.append(f"{place}: {shown[:40]}")
    return out


def uncut_length(batch: Any, parts: int) -> int:
    """The length of the first token-like tensor ([batch, sequence] integers or booleans: ids, labels, masks) that
    does not divide into `parts`, else 0. Float inputs are left alone: their dim 1 need not be the sequence."""
    for _, v in leaves(batch, ""):
        tokens = isinstance(v, torch.Tensor) and v.dim() == 2 and not (v.is_floating_point() or v.is_complex())
        if tokens and v.shape[1] % parts:
            return int(v.shape[1])
    return 0


def checksum(tensors: list[torch.Tensor]) -> int:
    """A CRC-32 of the tensors' bytes, in order: exact, so bit-identical batches agree on any device."""
    crc = 0
    for t in tensors:
        if t.is_meta or t.layout != torch.strided:
            continue  # no bytes to compare (shapes still are)
        host = t.detach().contiguous().cpu()  # a device tensor's bytes come to the host: the check compares there
        crc = zlib.crc32(host.reshape(-1).view(torch.uint8).numpy(), crc)
    return crc


class BatchAgreement:
    """The check of [Note: a batch agreed over the model-parallel group], over `comm`: the ranks given one batch
    (`Mesh.batch_group`), `stages` consecutive parts of it (one per pipeline stage), each of which must agree; `kind`
    names a part in errors."""

    def __init__(self, comm: Comm, *, kind: str, values: bool, stages: int = 1, sequence_parts: int = 1) -> None:
        if comm.size % stages:
            raise ValueError(f"a group of {comm.size} ranks does not cut into {stages} equal stages")
        self.comm = comm
        self.kind = kind  # "tensor-parallel" | "sequence-parallel"
        self.values = values  # compare the values too (check_collectives), not only the shapes
        self.stages = stages  # pipeline stages: each stage's ranks agree among themselves (what they are given may
        # differ between stages: a later stage may be given no inputs)
        # A sequence split's equal parts: only the stage holding the scatter would find a length that does not
        # divide, and the stages after it would wait for its activations until comm_timeout; the verdict rides in
        # the row, so every stage refuses the batch at once.
        self.sequence_parts = sequence_parts
        self.checks = 0  # batches agreed: the same on every rank
        self._covered = 0  # entries open whose whole batch was agreed: the forwards inside check nothing more

    @classmethod
    def of(cls, mesh: Mesh, *, values: bool) -> BatchAgreement:
        kind = "sequence-parallel" if mesh.sp.size > 1 else "tensor-parallel"
        stages = mesh.pp_size if mesh.batch_group.size > 1 else 1
        return cls(mesh.batch_group, kind=kind, values=values, stages=stages, sequence_parts=mesh.sequence_parts)

    @contextlib.contextmanager
    def entry(self, batch: Any, where: str) -> Iterator[None]:
        """Agree on a whole batch (inputs and labels) at an entry point; forwards inside it are covered."""
        self.check(batch, where)
        self._covered += 1
        try:
            yield
        finally:
            self._covered -= 1

    def check(self, batch: Any, where: str) -> None:
        """Raise `BatchMismatchError` on every rank of the group unless the ranks of each stage were given the same
        batch."""
        if self.comm.size == 1 or self._covered:
            return
        self.checks += 1
        lines = describe(batch)
        values = 0
        if self.values:
            values = checksum([v for _, v in leaves(batch, "") if isinstance(v, torch.Tensor)])
        uncut = uncut_length(batch, self.sequence_parts) if self.sequence_parts > 1 else 0
        row = torch.tensor([_digest(where + "\n" + "\n".join(lines)), values, uncut], dtype=torch.int64)
        rows = torch.empty(self.comm.size * _ROW, dtype=torch.int64)
        ctl = self.comm.control
        ctl.all_gather(rows, row, what=f"the {self.kind} ranks' agreement on the batch of {where}")
        parts = rows.view(self.stages, -1, _ROW)  # [stage, rank of the stage, (structure, values, length)]
        apart = (parts[..., :2] != parts[:, :1, :2]).any(dim=1)  # [stage, (structure, values)]
        if not bool(apart.any()):
            self._check_lengths(rows.view(-1, _ROW)[:, 2].tolist(), where)
            return
        every = ctl.all_gather_object((where, lines))  # every rank is here: each saw the same rows
        shapes = [f"{w}: {'; '.join(ls) or 'nothing'}" for w, ls in every]
        if bool(apart[:, 0].any()):
            raise BatchMismatchError(self._shapes(apart[:, 0].tolist(), shapes), shapes=[ls for _, ls in every])
        raise BatchMismatchError(self._values(apart[:, 1].tolist(), parts[:, :, 1], shapes), shapes=None)

    def _check_lengths(self, uncut: list[int], where: str) -> None:
        """Every rank raises the same error when any rank's batch has a sequence length the split cannot cut."""
        bad = [(self.comm.global_rank(r), n) for r, n in enumerate(uncut) if n]
        if not bad:
            return
        rank, n = bad[0]
        raise ConfigError(
            f"{where}: sequence parallelism cuts each sequence into {self.sequence_parts} equal parts, and the batch "
            f"of global rank {rank} has sequences of length {n}: pad the sequences to a multiple of "
            f"{self.sequence_parts} (or change parallel.tensor). Nothing has run." + self._stopped()
        )

    def _part(self, c: int) -> list[int]:
        """Global ranks of stage c's part."""
        per = self.comm.size // self.stages
        return [self.comm.global_rank(r) for r in range(c * per, (c + 1) * per)]

    def _ranks(self, c: int) -> str:
        stage = f" of pipeline stage {c}" if self.stages > 1 else ""
        return f"the ranks of the {self.kind} group{stage} (global ranks {self._part(c)})"

    def _todo(self, *, shapes: bool) -> str:
        group = "sequence group" if self.kind == "sequence-parallel" else "tensor-parallel group"
        shard = (
            f"Every rank of a {group} must be given the same batch: shard the data by data-parallel rank only "
            "(engine.data_parallel_rank, engine.data_parallel_size), not by global rank; "
        )
        if shapes:
            return shard + (
                "drop a last partial batch (drop_last=True) or pad it to the full size; pad the sequences to the same "
                "length on these ranks."
            )
        return shard + "shuffle with the same seed on these ranks. (Values are compared while check_collectives is on.)"

    def _stopped(self) -> str:
        if self.stages == 1:
            return ""
        return f" Every rank of these pipeline stages (global ranks {self.comm.global_ranks}) stops with this error."

    def _shapes(self, apart: list[bool], shapes: list[str]) -> str:
        per = self.comm.size // self.stages
        lines = []
        for c in (c for c, bad in enumerate(apart) if bad):
            lines.append(f"{self._ranks(c)} were given batches that do not match:")
            for r, g in zip(range(c * per, (c + 1) * per), self._part(c)):
                lines.append(f"  rank {g} at {shapes[r]}")
        lines.append(self._todo(shapes=True) + self._stopped())
        return "\n".join(lines)

    def _values(self, apart: list[bool], sums: torch.Tensor, shapes: list[str]) -> str:
        per = self.comm.size // self.stages
        lines = []
        for c in (c for c, bad in enumerate(apart) if bad):
            groups: dict[int, list[int]] = {}
            for s, g in zip(sums[c].tolist(), self._part(c)):
                groups.setdefault(s, []).append(g)
            alike = " / ".join(str(ranks) for ranks in groups.values())
            lines.append(
                f"{self._ranks(c)} were given batches of the same shapes but different values (at "
                f"{shapes[c * per]}; ranks with equal values: {alike})."
            )
        lines.append(
            f"They compute one model on one batch: each would train on garbage. {self._todo(shapes=False)}"
            + self._stopped()
        )
        return "\n".join(lines)
