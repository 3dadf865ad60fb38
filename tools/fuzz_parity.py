"""Parity fuzzer: random combinations of hetero's features against a plain PyTorch loop on the same global batch.

    python tools/fuzz_parity.py [--cases N] [--seed S] [--standin/--no-standin] [--world 1|2] [--json]
                                [--timeout SECONDS] [--only-case I] [--verbose] [--log FILE]

Each case draws a ZeRO stage (0-3), where the optimizer states live (device, host, NVMe in a temporary directory) and
at stage 3 the parameters, a precision (fp32, bf16), gradient accumulation (1-3), `parallel.microbatches` (1-3, with
`train_batch`; at 1 either `train_batch` or the engine()/backward/step loop), clipping, the delayed parameter update
(warm-up 0), the update in backward, activation checkpointing (and offload), tiling with a small chunk size, and
the model's features: a parameter never used, one frozen, one frozen for the middle step only, an output head tied
to the embedding, a block called twice, a data-dependent (MoE-style) route to experts, some of which a rank may not
use. It runs on 1 or 2 data-parallel ranks (gloo, tests/dist.py's run_distributed) under the CPU stand-in of a GPU
by default (`HETERO_STANDIN=1`: sums formed on the device, copies through pinned memory, streams and events).

The reference is plain PyTorch on the global batch in float64 (the exact run) and in the case's precision (its own
rounding), each rank's micro-batch a backward of its own as in hetero; losses and final weights are checked as the
test suite does ([Note: tolerances from the arithmetic] in tests/tolerance.py); bf16 against a bf16 model with fp32
master weights, on the weight deltas where the run learns enough for them to mean something (else the losses only).
The delayed update is checked against the delayed algorithm (each forward one update stale: tests/test_delayed.py's
reference).

A combination hetero refuses with a ConfigError at initialize counts as "refused" (each kind of message printed
once), not as a failure; any other error, a disagreement or a hang (the case's timeout; every rank's stacks are
dumped) is a failure, printed with the case's configuration so it can be rerun with --only-case.

The ranks import this file afresh (tests/dist.py's rank server): edit it while a run goes on and its ranks train
another model than its reference.
"""

from __future__ import annotations

import argparse
import copy
import faulthandler
import json
import os
import random
import re
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

VOCAB, DIM, EXPERTS, SEQ, ROWS, STEPS = 32, 16, 3, 6, 2, 3  # ROWS: a micro-batch's rows on one rank
FEATURES = ("unused", "frozen", "midfreeze", "tied", "twice", "moe")
MID = (1, 2)  # the steps (from 0) in which "midfreeze" holds its layer frozen


@dataclass(kw_only=True)
class Case:
    """One drawn combination: what hetero is configured with and what the model has."""

    index: int
    world: int
    stage: int
    optimizer: str  # where the optimizer states live
    params: str  # where the parameters live (stage 3 only)
    precision: str
    accum: int
    micro: int
    api: str  # "train_batch" or "loop" (engine(), backward, step)
    clip: float | None
    delayed: bool
    in_backward: bool
    checkpointing: bool
    act_offload: bool
    tiling: bool
    chunk: int
    features: list[str] = field(default_factory=list)

    def config(self, nvme_dir: str | None) -> dict:
        cfg: dict[str, Any] = {
            "zero_stage": self.stage,
            "precision": self.precision,
            "grad_accumulation_steps": self.accum,
            "chunk_size": self.chunk,
            "tiling": self.tiling,
            "offload": {"optimizer": self.optimizer, "params": self.params},
            "progress": False,
        }
        if self.micro > 1:
            cfg["parallel"] = {"microbatches": self.micro}
        if self.clip is not None:
            cfg["grad_clip_norm"] = self.clip
        if self.delayed:
            cfg.update(delayed_param_update=True, delayed_param_update_warmup=0)
        if self.in_backward:
            cfg["update_in_backward"] = True
        if self.checkpointing:
            cfg["activation_checkpointing"] = ["Block"]
            cfg["activation_offload"] = self.act_offload
        if nvme_dir is not None:
            cfg["memory"] = {"nvme_dir": nvme_dir}
        return cfg


def draw(rng: random.Random, index: int, world: int) -> Case:
    stage = rng.randint(0, 3)
    micro = rng.randint(1, 3)
    checkpointing = rng.random() < 0.3
    return Case(
        index=index,
        world=world,
        stage=stage,
        optimizer=rng.choice(["device", "host", "nvme"]),
        params=rng.choice(["device", "host", "nvme"]) if stage == 3 else "device",
        precision=rng.choice(["fp32", "fp32", "bf16"]),
        accum=rng.randint(1, 3),
        micro=micro,
        api="train_batch" if micro > 1 else rng.choice(["train_batch", "loop"]),
        clip=0.3 if rng.random() < 0.4 else None,
        delayed=rng.random() < 0.25,
        in_backward=rng.random() < 0.25,
        checkpointing=checkpointing,
        act_offload=checkpointing and rng.random() < 0.5,
        tiling=rng.random() < 0.5,
        chunk=rng.choice([256, 512, 1024]),
        features=[f for f in FEATURES if rng.random() < 0.35],
    )


class Block(nn.Module):
    """A residual layer; with `moe`, a top-1-style route to experts steered by the token ids (inside a block, where
    stage 3 allows data-dependent use: [Note: units])."""

    def __init__(self, moe: bool = False) -> None:
        super().__init__()
        self.lin = nn.Linear(DIM, DIM)
        if moe:
            self.router = nn.Linear(DIM, EXPERTS, bias=False)
            self.experts = nn.ModuleList(nn.Linear(DIM, DIM) for _ in range(EXPERTS))

    def forward(self, x: torch.Tensor, ids: torch.Tensor | None = None) -> torch.Tensor:
        h = x + torch.tanh(self.lin(x))
        if ids is None or not hasattr(self, "experts"):
            return h
        gate = self.router(h).softmax(-1)
        route = ids % (EXPERTS + 1)  # route EXPERTS: no expert; an expert no token takes is not called
        out = torch.zeros_like(h)
        for e, expert in enumerate(self.experts):
            mask = route == e
            if bool(mask.any()):
                out = out + torch.where(mask.unsqueeze(-1), gate[..., e : e + 1] * expert(h), 0.0)
        return h + out


class Net(nn.Module):
    """A tiny language model carrying the case's features."""

    def __init__(self, features: list[str]) -> None:
        super().__init__()
        self.features = tuple(features)
        self.emb = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList([Block(), Block(moe="moe" in features)])
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        if "tied" in features:
            self.head.weight = self.emb.weight
        if "unused" in features:
            self.unused = nn.Linear(DIM, DIM)
        if "frozen" in features:
            self.frozen = nn.Linear(DIM, DIM)
            self.frozen.requires_grad_(False)
        if "midfreeze" in features:
            self.mid = nn.Linear(DIM, DIM)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor | None = None) -> Any:
        h = self.emb(ids)
        if "frozen" in self.features:
            h = h + 0.5 * torch.tanh(self.frozen(h))
        h = self.blocks[0](h)
        if "twice" in self.features:
            h = self.blocks[0](h)  # one module, its weights used twice in one forward
        if "mid" in self._modules:
            h = h + torch.tanh(self.mid(h))
        h = self.blocks[1](h, ids)
        logits = self.head(h)
        if labels is None:
            return logits
        return {"loss": F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten()).to(logits.dtype)}


def build(case: Case) -> Net:
    torch.manual_seed(1000 + case.index)
    return Net(case.features)


def optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)


def batches(case: Case) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Global batches, one per accumulation step: learnable (the next token a fixed function of the last)."""
    g = torch.Generator().manual_seed(2000 + case.index)
    rows = ROWS * case.micro * case.world
    out = []
    for _ in range(STEPS * case.accum):
        x = torch.randint(0, VOCAB, (rows, SEQ), generator=g)
        out.append((x, (3 * x + 1) % VOCAB))
    return out


def _set_mid(model: nn.Module, step: int) -> None:
    if hasattr(model, "mid"):
        model.mid.requires_grad_(not (MID[0] <= step < MID[1]))


def reference(case: Case, dtype: torch.dtype) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Plain PyTorch on the global batch: the model in `dtype`, master weights (fp32 under bf16) stepped by the
    optimizer; under the delayed update the forward model holds the values of the update before the last."""
    model = build(case)
    master_dtype = torch.float32 if dtype == torch.bfloat16 else dtype
    master = copy.deepcopy(model).to(master_dtype)
    model = model.to(dtype)
    opt = optimizer(master)
    data = batches(case)
    losses = []
    for step in range(STEPS):
        _set_mid(model, step)
        total = 0.0
        for x, y in data[step * case.accum : (step + 1) * case.accum]:
            # Each rank's micro-batch on its own, as hetero computes it, the gradients summed in the master's dtype:
            # bf16 rounds each micro-batch's gradient, and a whole batch's lands elsewhere (in a bias's Adam delta:
            # 0.0201 from float64 split in three, 0.00095 whole).
            for xs, ys in zip(x.chunk(case.world * case.micro), y.chunk(case.world * case.micro)):
                loss = model(xs, labels=ys)["loss"] / (case.accum * case.world * case.micro)
                loss.backward()
                total += float(loss.detach())
                with torch.no_grad():
                    for p, pm in zip(model.parameters(), master.parameters()):
                        if p.grad is not None:
                            g, p.grad = p.grad.to(master_dtype), None
                            pm.grad = g if pm.grad is None else pm.grad + g
        losses.append(total)
        with torch.no_grad():
            if case.clip is not None:
                torch.nn.utils.clip_grad_norm_(master.parameters(), case.clip)
            if case.delayed:  # the pending update's values reach the model before the next is taken
                for p, pm in zip(model.parameters(), master.parameters()):
                    p.copy_(pm)
        opt.step()
        opt.zero_grad()
        if not case.delayed:
            with torch.no_grad():
                for p, pm in zip(model.parameters(), master.parameters()):
                    p.copy_(pm)
    return losses, {k: v.detach().to(dtype).float().clone() for k, v in master.state_dict().items()}


def run_rank(rank: int, world: int, case: Case, root: str, deadline: float) -> dict:
    """hetero on this rank's rows of each global batch; a ConfigError from initialize is a refusal. `deadline`: the
    wall-clock time (time.time()) at which the case is killed; this rank's stacks are written shortly before."""
    import hetero

    stacks = open(os.path.join(root, f"stacks-rank{rank}.txt"), "w")  # noqa: SIM115 (open until the rank ends)
    faulthandler.dump_traceback_later(max(deadline - time.time() - 3, 0.5), file=stacks)
    torch.set_num_threads(1)
    model = build(case)
    nvme = None
    if "nvme" in (case.optimizer, case.params):
        nvme = os.path.join(root, f"nvme{rank}")
        os.makedirs(nvme, exist_ok=True)
    try:
        engine = hetero.initialize(model, optimizer(model), case.config(nvme))
    except hetero.ConfigError as e:
        return {"refused": str(e)}
    local = ROWS * case.micro
    data = batches(case)
    losses = []
    for step in range(STEPS):
        _set_mid(model, step)
        total = torch.zeros(())
        for x, y in data[step * case.accum : (step + 1) * case.accum]:
            x, y = x[rank * local : (rank + 1) * local], y[rank * local : (rank + 1) * local]
            if case.api == "train_batch":
                total += float(engine.train_batch(x, y)) / case.accum / world  # already the global mean
            else:
                loss = engine(x, labels=y)["loss"]
                engine.backward(loss)
                engine.step()
                total += loss.detach().float().cpu() / case.accum
        engine.comm.control.all_reduce(total, op="avg" if case.api == "loop" else "sum")
        losses.append(total.item())
    state = {k: v.float() for k, v in engine.full_state_dict().items()}
    engine.close()
    faulthandler.cancel_dump_traceback_later()
    return {"losses": losses, "state": state if rank == 0 else None}


def check(case: Case, got: dict) -> tuple[str, str]:
    """("agreed" | "failed", detail): losses and weights against plain PyTorch as tests/tolerance.py bounds them."""
    from tests import tolerance

    dtype = torch.bfloat16 if case.precision == "bf16" else torch.float32
    exact_losses, exact = reference(case, torch.float64)
    plain_losses, plain = reference(case, dtype)
    try:
        tolerance.assert_losses(got["losses"], exact_losses, plain_losses, dtype=dtype)
        if dtype == torch.float32:
            tolerance.assert_weights(got["state"], exact, plain, dtype=dtype)
        else:
            initial = {k: v.detach().float() for k, v in build(case).state_dict().items()}
            try:
                tolerance.assert_learns(exact, plain, initial)
            except AssertionError:
                return "agreed", "losses only (bf16 deltas too small to check)"
            tolerance.assert_weights(got["state"], exact, plain, dtype=dtype, initial=initial)
    except AssertionError as e:
        return "failed", f"{e}\n  hetero losses {got['losses']}\n  exact  losses {exact_losses}"
    return "agreed", ""


def run_case(case: Case, timeout: float) -> dict:
    from tests.dist import DistributedTestError, run_distributed

    with tempfile.TemporaryDirectory(prefix="hetero-fuzz-") as root:
        start = time.monotonic()
        try:
            results = run_distributed(run_rank, case.world, case, root, time.time() + timeout, timeout=timeout)
        except TimeoutError as e:
            stacks = ""
            for rank in range(case.world):
                path = os.path.join(root, f"stacks-rank{rank}.txt")
                if os.path.exists(path):
                    stacks += f"--- rank {rank} ---\n" + open(path).read()  # noqa: SIM115
            return {"outcome": "hung", "detail": f"{e}\n{stacks}"}
        except DistributedTestError as e:
            return {"outcome": "failed", "detail": str(e)[-4000:]}
        seconds = time.monotonic() - start
    if "refused" in results[0]:
        return {"outcome": "refused", "detail": results[0]["refused"]}
    outcome, detail = check(case, results[0])
    return {"outcome": outcome, "detail": detail, "seconds": round(seconds, 2)}


def _warm(rank: int, world: int) -> None:
    pass


def refusal_kind(message: str) -> str:
    """The message without its numbers and names in quotes: one line a kind."""
    return re.sub(r"\d+|'[^']*'", "#", message.splitlines()[0])[:160]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", type=int, default=20, help="how many cases to draw (default 20)")
    parser.add_argument("--seed", type=int, default=0, help="the seed of the draws (default 0)")
    parser.add_argument(
        "--standin",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="run under the CPU stand-in of a GPU, HETERO_STANDIN=1 (default on)",
    )
    parser.add_argument("--world", type=int, choices=(1, 2), default=1, help="data-parallel ranks (default 1)")
    parser.add_argument("--timeout", type=float, default=90.0, help="seconds a case may take (default 90)")
    parser.add_argument("--only-case", type=int, default=None, help="run only the case of this index")
    parser.add_argument("--json", action="store_true", help="print one JSON object at the end instead of text")
    parser.add_argument("--verbose", action="store_true", help="print each case's configuration as it runs")
    parser.add_argument("--log", default=None, help="append each case's configuration and outcome to this JSONL file")
    args = parser.parse_args(argv)
    if args.standin:
        os.environ["HETERO_STANDIN"] = "1"
    else:
        os.environ.pop("HETERO_STANDIN", None)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from tqdm import tqdm

    from tests.dist import run_distributed

    run_distributed(_warm, args.world, timeout=300)  # the rank server starts (imports) outside the cases' timeouts
    rng = random.Random(args.seed)
    cases = [draw(rng, i, args.world) for i in range(args.cases)]
    if args.only_case is not None:
        cases = [c for c in cases if c.index == args.only_case]
    counts = {"cases": 0, "agreed": 0, "refused": 0, "failed": 0, "hung": 0}
    refusals: dict[str, str] = {}
    failures = []
    bar = tqdm(cases, disable=args.json, desc="fuzz", unit="case")
    for case in bar:
        if args.verbose:
            tqdm.write(json.dumps(asdict(case)))
        result = run_case(case, args.timeout)
        if args.log:
            with open(args.log, "a") as log:
                log.write(json.dumps({"case": asdict(case), **result}) + "\n")
        counts["cases"] += 1
        counts[result["outcome"]] += 1
        if result["outcome"] == "refused":
            kind = refusal_kind(result["detail"])
            if kind not in refusals:
                refusals[kind] = result["detail"]
                if not args.json:
                    tqdm.write(f"refused (case {case.index}): {result['detail']}")
        elif result["outcome"] in ("failed", "hung"):
            failures.append({"case": asdict(case), **result})
            if not args.json:
                tqdm.write(f"{result['outcome'].upper()} case {case.index}: {json.dumps(asdict(case))}")
                tqdm.write(result["detail"])
        bar.set_postfix({k: v for k, v in counts.items() if k != "cases"})
    report = {"seed": args.seed, "world": args.world, "standin": args.standin, **counts}
    if args.json:
        print(json.dumps({**report, "refusals": list(refusals.values()), "failures": failures}))
    else:
        print(json.dumps(report))
    return 1 if counts["failed"] or counts["hung"] else 0


if __name__ == "__main__":
    sys.exit(main())
