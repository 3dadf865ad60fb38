"""Execute a pipeline schedule: this rank's forwards and backwards, with activations and their gradients passed
point-to-point between neighbouring stages.

[Note: transfers]
The rank runs its `schedule.program`: actions, and between steps an Exchange that starts the step's sends and the
next step's receives as one group ([Note: steps and exchanges] in schedule.py). An exchange goes in two groups:
fixed-size headers (micro-batch, destination virtual stage, dtype, shape), then the payloads, so the receiver can
allocate without knowing the model; each header is checked, so ranks that disagree fail with a clear error instead
of computing with the wrong tensor. Every transfer carries a tag unique to its message, which gloo matches by; NCCL
matches by order, which `schedule.programs` proves consistent on both sides of every link and free of deadlock even
when every send waits for its receive (it replays them, splitting exchanges where needed: [Note: split exchanges]).
Receives are waited before the step that needs them, sends at the next exchange ([Note: sends waited at the next
exchange]). An activation's header also
carries a digest of what the stages read from their own copies of the micro-batch rather than receive (a Hugging
Face model's attention mask and positions: [Note: a padded batch through the stages] in hf.py), which the receiver
compares with its own; a mismatch stops it as an error of its own would.

[Note: sends waited at the next exchange]
A send's tensor must stay alive until the send completes. Waited at the end of the batch, every output a stage sent
and every input gradient it sent back were held to the end: on the first stage of 1F1B, all m micro-batches' outputs
beside the p in flight the schedule promises (and in evaluation, where nothing else is kept, every micro-batch's
output), growing with the batch. So each exchange first waits for the sends of the ones before it (`settle`) and
drops them. That is no new wait: `schedule.programs` replays every program with each group of transfers complete,
its sends included, before the rank's next group is posted ([Note: steps and exchanges]), and found it free of
deadlock so; by the next exchange the receiver has posted the matching receive in all but that worst case.

[Note: a stage that raises]
A forward or backward that raises (a user's loss_fn, a hook, a shape error) would leave the stages after it waiting
for its activations, and those before it for its gradients, until comm_timeout (600 s by default), which then names
it as dead or hung. Instead the rank keeps to its program without computing: every message it owes goes as a header
marked stopped (code -2, with the pipeline rank that raised first) and no payload, and a rank that receives one stops
computing too and passes the mark on. The programs complete as they would have (their exchanges are unchanged, which
is what the replay proved free of deadlock), then the rank that raised raises its own error and every other rank a
PipelineError naming it; where the rank that raised first failed in a collective (a CommError: a mismatch, a rank gone),
the mark says so, and the others raise PipelineCommError, a CommError too: nothing more may be sent, so they agree with
no data-parallel peer either. The marks cover the pipeline group only; the engine covers the rest: a tensor-parallel
rank that raised posts its failure for good, which stops the peers waiting in its layer's collectives within a second
([Note: a forward that fails] in engine.py), and the data-parallel replicas of a stage agree on a batch that raised on
some of them ([Note: a batch that raises on some data-parallel ranks] in batches.py).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from hetero.comm import Comm
from hetero.errors import CommError, HeteroError
from hetero.parallel.pipeline.schedule import Action, Exchange, Message, build, programs, stage
from hetero.parallel.pipeline.split import StageChunk

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32, torch.bool]
MAX_DIMS = 8
HEADER = 5 + MAX_DIMS  # micro-batch, virtual stage, dtype code, ndim, shape, the micro-batch's side digest
SIDE = HEADER - 1  # an activation's header: the digest of what every stage reads from its own copy of the batch


def _sendable(t: torch.Tensor) -> bool:
    """Whether a header can describe `t` (its dtype listed, at most MAX_DIMS dims)."""
    return t.dtype in DTYPES and t.dim() <= MAX_DIMS


class PipelineError(HeteroError, RuntimeError):
    """Stages disagree on what they exchange, or a stage produced something that cannot be passed on."""


STOPPED = -2  # a header's dtype code: no payload follows, its sender stopped ([Note: a stage that raises])


class PipelineCommError(PipelineError, CommError):
    """The stage that stopped this pipeline failed in a collective (a mismatch, a rank gone): nothing more may be sent,
    so this rank agrees with nobody either ([Note: a stage that raises])."""


class Halt:
    """Whether this rank stopped computing in a batch: its own error, or the pipeline rank that raised first."""

    def __init__(self) -> None:
        self.error: Exception | None = None  # this rank's own
        self.origin: int | None = None  # the pipeline rank that raised first, as far as this rank knows
        self.broken = False  # that rank's error was a failed collective (CommError)

    def fail(self, error: Exception, rank: int) -> None:
        self.error, self.origin, self.broken = error, rank, isinstance(error, CommError)

    def heard(self, origin: int, broken: bool = False) -> None:
        if self.origin is None:
            self.origin, self.broken = origin, broken

    def raise_if_stopped(self, pp: Comm) -> None:
        if self.error is not None:
            raise self.error
        if self.origin is not None:
            raise (PipelineCommError if self.broken else PipelineError)(
                f"pipeline rank {self.origin} (global rank {pp.global_rank(self.origin)}) raised during this batch: "
                "see its error. This rank stopped with it, its schedule's exchanges run through without computing "
                "so that no stage waits for another until comm_timeout"
            )


@dataclass
class RunStats:
    """What one batch through the pipeline cost this rank (filled when the runtime measures)."""

    wall_s: float = 0.0  # the batch's schedule, first action to last
    wait_s: float = 0.0  # blocked in receives: the bubble, as this rank saw it
    peak_saved_bytes: int = 0  # activations saved for backward alive at once (parameters excluded)
    peak_in_flight: int = 0  # micro-batch chunks forwarded and not yet backwarded, at most at once
    actions: list[tuple[str, float, float]] = field(default_factory=list)  # (action, start, end) relative to start


class PipelineRuntime:
    def __init__(
        self,
        chunks: list[StageChunk],
        pp: Comm,
        *,
        schedule: str,
        microbatches: int,
        virtual: int,
        device: torch.device,
    ) -> None:
        self.chunks = chunks  # this rank's model chunks; chunks[c] is virtual stage c * p + rank (Chimera: see there)
        self.pp = pp
        self.schedule = schedule
        self.p, self.v, self.m = pp.size, virtual, microbatches
        self.actions: list[Action] = build(schedule, self.p, microbatches, pp.rank, virtual)
        self.last_stage = self.p * self.v - 1
        # Every rank derives every rank's program, replayed under NCCL's worst case (schedule.programs): a schedule
        # that could hang never starts, on any backend.
        self.program = programs(schedule, self.p, microbatches, virtual)[pp.rank]
        self.device = device  # where received tensors are allocated
        # NCCL sets a group's communicator up at its first collective: make that one every rank takes part in.
        pp.barrier()
        self.measure = False  # fill `stats` (saved-tensor accounting costs a hook per saved tensor)
        self.stats = RunStats()

    def run(
        self,
        inputs: list[Any],
        labels: list[Any],
        *,
        loss_fn: Callable[[Any, Any], torch.Tensor] | None,
        loss_scale: float,
        after_forward: Callable[[], None],
        after_backward: Callable[[], None],
    ) -> torch.Tensor:
        """Run the batch's actions; return the sum of the micro-batches' losses (on the last stage, else 0).

        loss_scale multiplies each micro-batch's loss before its backward (1 / micro-batches, times a loss scale)."""
        saved: dict[tuple[int, int], tuple[Any, torch.Tensor]] = {}  # (chunk, micro-batch) -> (input, output)
        inbox: dict[Message, torch.Tensor] = {}  # received, not yet used
        outbox: dict[Message, torch.Tensor] = {}  # computed, to go out at the next exchange
        sends: list[Any] = []  # handles and the tensors they read, waited at the next exchange
        total = torch.zeros((), dtype=torch.float32)
        stats = self.stats = RunStats()
        alive: dict[tuple[int, int], int] = {}  # saved-for-backward bytes per (chunk, micro-batch), when measuring
        t0 = time.perf_counter()
        halt = Halt()
        side = self.side_digests(inputs)
        for item in self.program:
            if isinstance(item, Exchange):
                start = time.perf_counter()
                try:
                    settle(sends)
                    sends += self.exchange(item, outbox, inbox, halt, side)
                except Exception:
                    halt.raise_if_stopped(self.pp)  # the error that stopped this rank is the one to see
                    raise
                stats.wait_s += time.perf_counter() - start
                continue
            if halt.origin is not None:
                continue  # stopped: the exchanges go on, marked ([Note: a stage that raises])
            a, start = item, time.perf_counter()
            s = stage(a, self.p, self.pp.rank)
            key = (a.chunk, a.microbatch)
            try:
                total += self._act(a, s, key, inputs, labels, saved, inbox, outbox, alive, loss_fn, loss_scale)
                (after_forward if a.kind == "F" else after_backward)()
            except Exception as e:
                halt.fail(e, self.pp.rank)
                continue
            if self.measure:
                stats.actions.append((repr(a), start - t0, time.perf_counter() - t0))
        settle(sends)
        halt.raise_if_stopped(self.pp)
        assert not inbox and not outbox, "the program left messages unused"  # check_rendezvous rules this out
        stats.wall_s = time.perf_counter() - t0
        return total

    def _act(
        self,
        a: Action,
        s: int,
        key: tuple[int, int],
        inputs: list[Any],
        labels: list[Any],
        saved: dict,
        inbox: dict,
        outbox: dict,
        alive: dict,
        loss_fn: Callable[[Any, Any], torch.Tensor] | None,
        loss_scale: float,
    ) -> torch.Tensor:
        """One forward or backward of the program; returns its loss (on the last stage's forwards), else 0."""
        stats = self.stats
        total = torch.zeros((), dtype=torch.float32)
        if a.kind == "F":
            if s == 0:
                x = inputs[a.microbatch]
            else:
                x = inbox.pop((0, a.microbatch, s))
                if x.is_floating_point():
                    x.requires_grad_(True)
            last = s == self.last_stage
            with self._saving(alive, key):
                y = self.chunks[a.chunk](
                    x, labels[a.microbatch] if last and loss_fn is None else None, batch=inputs[a.microbatch]
                )
                if last:
                    y = loss_fn(y, labels[a.microbatch]) if loss_fn is not None else loss_of(y)
                    check_loss(y, "loss_fn" if loss_fn is not None else "the last stage's .loss")
            if last:
                total += y.detach().float().cpu()
            else:
                if not isinstance(y, torch.Tensor):
                    raise PipelineError(
                        f"virtual stage {s} returned {type(y).__name__}; a stage must return one tensor to pass "
                        "to the next (split the model where a single tensor flows between units)"
                    )
                outbox[(0, a.microbatch, s + 1)] = y.detach()
            saved[key] = (x, y)
            stats.peak_in_flight = max(stats.peak_in_flight, len(saved))
            stats.peak_saved_bytes = max(stats.peak_saved_bytes, sum(alive.values()))
        else:
            x, y = saved.pop(key)
            if s == self.last_stage:
                torch.autograd.backward(y * loss_scale)
            else:
                grad = inbox.pop((1, a.microbatch, s))
                # A stage whose parameters are all frozen (a fine-tuned model's first stage) and that takes
                # no gradient in has nothing to run backward through: the gradient it was sent ends here, on
                # this rank alone and without a collective, where backward would raise.
                if y.requires_grad:
                    torch.autograd.backward(y, grad)
            alive.pop(key, None)
            if s > 0:
                outbox[(1, a.microbatch, s - 1)] = x.grad if x.grad is not None else torch.zeros_like(x)
            del x, y
        return total

    # ---- transfers ------------------------------------------------------------------------------------------
    def side_digests(self, inputs: list[Any]) -> list[int]:
        """Per micro-batch, the digest of what this rank's stages read from their own copy of it (0: nothing);
        one copy to the host for the batch."""
        digests = [self.chunks[0].side_digest(x) for x in inputs]
        if all(d is None for d in digests):
            return [0] * len(inputs)
        dev = next(d.device for d in digests if d is not None)
        zero = torch.zeros((), dtype=torch.int64, device=dev)
        return torch.stack([d.to(dev) if d is not None else zero for d in digests]).tolist()

    def _tag(self, kind: int, microbatch: int, stage: int) -> int:
        return (microbatch * (self.last_stage + 1) + stage) * 2 + kind

    def _header(self, t: torch.Tensor | None, msg: Message, halt: Halt | None, side: int = 0) -> torch.Tensor:
        """The header (on the payload's device: NCCL reads GPU memory only). A tensor no header can describe gets
        code -1: the header still goes, so the receiver fails with the sender instead of waiting for it. None: this
        rank stopped (STOPPED, and the pipeline rank that raised first)."""
        header = torch.zeros(HEADER, dtype=torch.int64)
        if t is None:
            origin = halt.origin if halt is not None and halt.origin is not None else self.pp.rank
            broken = int(halt is not None and halt.broken)
            header[:5] = torch.tensor([msg[1], msg[2], STOPPED, broken, origin])
            return header.to(self.device)
        if _sendable(t):
            header[:4] = torch.tensor([msg[1], msg[2], DTYPES.index(t.dtype), t.dim()])
            header[4 : 4 + t.dim()] = torch.tensor(t.shape, dtype=torch.int64)
            header[SIDE] = side
        else:
            header[:4] = torch.tensor([msg[1], msg[2], -1, 0])
        return header.to(t.device)

    def exchange(
        self,
        ex: Exchange,
        outbox: dict[Message, torch.Tensor],
        inbox: dict[Message, torch.Tensor],
        halt: Halt | None = None,
        side: list[int] | None = None,
    ) -> list[tuple[Any, Any]]:
        """Start the exchange's sends, complete its receives into `inbox`; return the sends' handles. `halt`: once
        this rank stopped, what it did not compute goes marked, and marks received stop it ([Note: a stage that
        raises]). `side`: this rank's digest of each micro-batch ([Note: transfers]), sent with its activations and
        compared with those received."""
        stopped = halt is not None and halt.origin is not None
        out = [(peer, msg, self._outgoing(outbox, msg, stopped)) for peer, msg in ex.sends]
        digest = [side[msg[1]] if side is not None and msg[0] == 0 else 0 for _, msg, _ in out]
        headers_out = [self._header(t, msg, halt, d) for (_, msg, t), d in zip(out, digest)]
        headers_in = [torch.empty(HEADER, dtype=torch.int64, device=self.device) for _ in ex.recvs]
        ops = [("send", h, peer, self._tag(*msg)) for (peer, msg, _), h in zip(out, headers_out)]
        ops += [("recv", h, peer, self._tag(*msg)) for (peer, msg), h in zip(ex.recvs, headers_in)]
        handles = self.pp.batch_p2p(ops)
        for h in handles[len(out) :]:
            h.wait()
        pending = [(h, headers_out) for h in handles[: len(out)]]
        bad = [t for _, _, t in out if t is not None and not _sendable(t)]
        if bad:
            for h in handles[: len(out)]:  # the marked headers delivered before this rank stops (and drops them)
                h.wait()
            raise PipelineError(
                f"cannot pass a {bad[0].dtype} tensor of {bad[0].dim()} dims between stages (at most {MAX_DIMS} dims, "
                f"of {', '.join(str(d).removeprefix('torch.') for d in DTYPES)}): return one from the stage"
            )
        payloads = []
        for (peer, msg), header in zip(ex.recvs, headers_in):
            values = header.tolist()  # one copy to the host per header
            mb, st, code, ndim = values[:4]
            if code == STOPPED and halt is not None:
                halt.heard(values[4], bool(ndim))
                payloads.append(None)
                continue
            if code < 0:
                raise PipelineError(
                    f"pipeline rank {peer} could not pass its tensor for virtual stage {msg[2]} (a dtype or a number "
                    "of dims a stage cannot send): its own error says which"
                )
            if (mb, st) != (msg[1], msg[2]):
                what = ("activation", "gradient")[msg[0]]
                raise PipelineError(
                    f"pipeline rank {self.pp.rank} expected the {what} of micro-batch {msg[1]} for virtual stage "
                    f"{msg[2]} from rank {peer} and received micro-batch {mb} for stage {st}: the ranks run "
                    "different schedules"
                )
            shape = values[4 : 4 + ndim]
            payloads.append(torch.empty(shape, dtype=DTYPES[code], device=self.device))
            if side is not None and msg[0] == 0 and values[SIDE] != side[mb]:
                self._side_differs(peer, mb, halt)
        # Marked messages carry no payload, on either side: both read it from the same header.
        sent = [(peer, msg, t) for peer, msg, t in out if t is not None]
        ops = [("send", t, peer, self._tag(*msg)) for peer, msg, t in sent]
        ops += [("recv", t, peer, self._tag(*msg)) for (peer, msg), t in zip(ex.recvs, payloads) if t is not None]
        handles = self.pp.batch_p2p(ops)
        for h in handles[len(sent) :]:
            h.wait()
        pending += [(h, [t for _, _, t in sent]) for h in handles[: len(sent)]]  # the tensors outlive the sends
        for (_, msg), t in zip(ex.recvs, payloads):
            if t is not None:
                inbox[msg] = t
        return pending

    def _side_differs(self, peer: int, mb: int, halt: Halt | None) -> None:
        """This rank's copy of micro-batch `mb` is not the one its activations were computed on: stop (the transfer
        completes, so that no rank waits for it)."""
        error = PipelineError(
            f"pipeline rank {self.pp.rank} was given another attention mask or position ids for micro-batch {mb} than "
            f"pipeline rank {peer} computed its activations with: every stage reads them from the batch it is given "
            "(hf.py, [Note: a padded batch through the stages]). Pass every pipeline rank the same inputs: a dict of "
            "input_ids, attention_mask and position_ids, or the ids alone"
        )
        if halt is None:
            raise error
        if halt.origin is None:
            halt.fail(error, self.pp.rank)

    @staticmethod
    def _outgoing(outbox: dict[Message, torch.Tensor], msg: Message, stopped: bool) -> torch.Tensor | None:
        """The message's tensor; None where a stopped rank did not compute it."""
        t = outbox.pop(msg, None) if stopped else outbox.pop(msg)
        return t.contiguous() if t is not None else None

    # ---- measuring ------------------------------------------------------------------------------------------
    def _saving(self, alive: dict, key: tuple[int, int]) -> Any:
        if not self.measure:
            return _Null()
        params = {p.untyped_storage().data_ptr() for c in self.chunks for _, u in c.units for p in u.parameters()}
        seen: set[int] = set()
        alive[key] = 0

        def pack(t: torch.Tensor) -> torch.Tensor:
            ptr = t.untyped_storage().data_ptr()
            if ptr not in params and ptr not in seen:
                seen.add(ptr)
                alive[key] += t.untyped_storage().nbytes()
            return t

        return torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)


def settle(sends: list[tuple[Any, Any]]) -> None:
    """Wait for earlier exchanges' sends and drop them with the tensors they read ([Note: sends waited at the next
    exchange])."""
    for handle, _ in sends:
        handle.wait()
    sends.clear()


class _Null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> None:
        return None


def check_loss(loss: Any, source: str) -> None:
    """A micro-batch's loss is one number: anything else failed later in a sum or in backward, without saying why."""
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        what = f"a tensor of shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor) else type(loss).__name__
        raise PipelineError(
            f"{source} returned {what}; a micro-batch's loss must be a tensor of one element (reduce it: mean or "
            "sum over the micro-batch)"
        )


def loss_of(out: Any) -> torch.Tensor:
    loss = getattr(out, "loss", None)
    if loss is None and isinstance(out, dict):
        loss = out.get("loss")
    if loss is None:
        raise PipelineError(
            "the last stage returned no .loss: with loss_fn=None its last unit is called with labels= and must "
            "return an object with a loss (Hugging Face style); otherwise pass loss_fn to train_batch"
        )
    return loss
