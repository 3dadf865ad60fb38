"""Training step time of hetero at ZeRO stages 0-3 against plain PyTorch, PyTorch FSDP2 and DeepSpeed.

    python benchmarks/step_time.py [--json] [--steps N] [--warmup W] [--layers L] [--embd E] [--heads H]
                                   [--seq T] [--batch B] [--vocab V] [--with-nvme DIR] [--rounds R]
                                   [--wait-idle S] [--only NAME,...] [--builtin-model] [--keep-logs DIR]
                                   [--timeout S] [--model gpt|llama] [--intermediate I] [--max-in-cpu N]
                                   [--hetero-config JSON] [--deepspeed-config JSON]

Every configuration trains the same GPT-style model (hetero.models.gpt when it is importable, else the small
nanoGPT-like model in this file; with --model llama, transformers' LlamaForCausalLM at the same shape) from the
same seed on the same synthetic token batches, in fp32 with AdamW, for W warm-up steps then N timed steps, each
configuration in fresh processes (so peak RSS is its own):

  plain       plain PyTorch, world size 1, 2 intra-op threads, the whole global batch (2 x B sequences)
  fsdp2       torch.distributed.fsdp.fully_shard on every block and on the root, world size 2 on gloo
  floor       world size 2, each rank its own forward, backward and fused AdamW on half the parameters, with no
              communication at all: the least any sharded engine's step can take on this machine; each race
              reports it over the peer's step (floor_ratio)
  floor_zero3 the floor plus the least a ZeRO-3 step sends: one all-gather of the parameters and one
              reduce-scatter of the gradients, both started before forward and waited for after backward, through
              hetero's Comm (its cross-memory transport: the fastest any engine here has) (floor_zero3_ratio);
              a race says when its step target lies below the lower of the floors it measured
  hetero_sK   hetero.initialize with zero_stage K (0..3), world size 2 on gloo, its large CPU collectives by
              cross-memory reads between the ranks (hetero/comm/cma.py)
  hetero_stage3_gloo, hetero_stage3_nvme_gloo   the same with HETERO_CPU_TRANSPORT=gloo: every byte through gloo,
              as the peers move theirs (races vs_fsdp2_on_gloo, vs_deepspeed_nvme_on_gloo, for information)
  deepspeed   DeepSpeed ZeRO-3 (DS_ACCELERATOR=cpu), world size 2 on gloo, when DeepSpeed is importable
  *_nvme      with --with-nvme DIR: hetero stage 3 and DeepSpeed ZeRO-3 with params and optimizer states on NVMe;
              both keep the same parameter elements in host memory (--max-in-cpu N: DeepSpeed's
              offload_param.max_in_cpu, hetero's offload.params_host_bytes at 4 bytes an element; default
              DeepSpeed's own 1e9, which keeps every parameter of these models there; 0 puts them all on NVMe)
  hetero_stage3_nvme_ib      with --with-nvme DIR: hetero_stage3_nvme with update_in_backward (each chunk steps
              as its gradient is final, its NVMe states read and written during backward; the same arithmetic,
              since nothing here clips), raced against DeepSpeed's NVMe configurations for information
  deepspeed_nvme_pipelined   with --with-nvme DIR: DeepSpeed's NVMe offload with its optimizer stepped in
              sub-groups (a sixth of the rank's parameters each), the next one's states read and the last one's
              written while one steps (offload_optimizer.pipeline_read and pipeline_write, 16 swap buffers); the
              race against DeepSpeed takes the better of its two NVMe configurations on each measure

The world-size-2 configurations run B sequences per rank, so every configuration does the same work per step:
2 x B sequences of T tokens, one optimizer update, and (with the gradients averaged over ranks) the same loss
trajectory up to float rounding. Cores: each rank gets 1 intra-op thread (2 ranks on 2 cores, no
oversubscription); plain PyTorch gets 2 threads, the same total. Step time is, per step, the slowest rank's wall
time, then the median over the timed steps (with --rounds R, the lowest of the rounds' medians). Peak RSS is
each process's high-water mark (VmHWM; a sampled psutil maximum where /proc is missing), torch import included;
rss_base_mb is the RSS before the model is built. The work of a step is counted too: CPU seconds (user and
system) and minor page faults, summed over ranks, median over the timed steps (cpu_s_per_step, sys_s_per_step,
page_faults_per_step; each race's cpu_ratio): on a shared machine other load changes them far less than the wall
time, so a change of a few percent that the step times' spread hides shows there.

The final loss of every configuration should match plain PyTorch's to float rounding (losses_agree); a gap means
an engine trains something else (DeepSpeed, for one, clips gradients at 1.0 unless told not to). The CPU share
other processes take while each configuration runs is measured: on a shared machine it makes timings unreliable
(a warning says so; --rounds R repeats everything, alternating the order, and keeps the least disturbed round;
--wait-idle S waits up to S seconds for an idle machine before each configuration).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import importlib.util
import json
import multiprocessing as mp
import os
import pickle
import queue as queue_mod
import resource
import shutil
import socket
import statistics
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any, NamedTuple

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import psutil  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

WORLD = 2  # this benchmark's data-parallel world: 2 ranks share the machine's 2 cores
TOTAL_THREADS = 2  # cores given to every configuration in all (ranks x threads per rank)
TARGET_VS_FSDP2 = 1.0  # hetero stage 3 against FSDP2, when everything fits in memory
TARGET_VS_PLAIN = 1.1  # hetero stage 3 against plain PyTorch, when everything fits in memory
BUSY_WARN_PCT = 10.0  # CPU share taken by other processes during a configuration that makes its timings suspect
LOSS_TOLERANCE = 1e-3  # largest per-step loss gap to plain PyTorch that float rounding explains at these sizes


@dataclasses.dataclass(frozen=True)
class ModelShape:
    vocab: int
    layers: int
    heads: int
    embd: int
    seq: int


@dataclasses.dataclass(frozen=True)
class Spec:
    """One configuration to run: what trains, on how many ranks, with how many threads each."""

    name: str
    kind: str  # "plain" | "fsdp2" | "hetero" | "deepspeed" | "floor"
    world: int
    threads: int
    batch: int  # sequences per rank per step
    shape: ModelShape
    steps: int
    warmup: int
    seed: int
    lr: float
    stage: int = 3  # ZeRO stage (hetero, deepspeed)
    nvme_dir: str | None = None  # params and optimizer states on NVMe under this directory
    max_in_cpu: int = 10**9  # with nvme_dir: parameter elements kept in host memory (DeepSpeed's default)
    builtin_model: bool = False  # MiniGPT even when hetero.models.gpt exists
    family: str = "gpt"  # "gpt": hetero.models.gpt (or MiniGPT); "llama": transformers' LlamaForCausalLM
    intermediate: int = 1312  # the Llama's MLP width
    delayed: bool = False  # hetero's delayed_param_update
    in_backward: bool = False  # hetero's update_in_backward
    pipelined: bool = False  # DeepSpeed with nvme_dir: its pipelined optimizer swapper over several sub-groups
    hetero_extra: str = ""  # JSON object of extra hetero config keys (--hetero-config), merged last
    deepspeed_extra: str = ""  # JSON object merged into DeepSpeed's config (--deepspeed-config), nested keys too
    transport: str = "cma"  # HETERO_CPU_TRANSPORT of hetero's ranks (and the floor's); "gloo": what peers have


# ------------------------------------------------------------------------------------------------ model
class GPTOutput(NamedTuple):
    """A named tuple, not a plain object: FSDP2 and DeepSpeed find the tensors of a module's output through
    pytree / tuple traversal to hook backward, and an opaque object would hide the loss from them."""

    loss: torch.Tensor | None
    logits: torch.Tensor


class _SelfAttention(nn.Module):
    def __init__(self, embd: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.c_attn = nn.Linear(embd, 3 * embd)
        self.c_proj = nn.Linear(embd, embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.c_attn(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).reshape(b, t, c))


class _Block(nn.Module):
    def __init__(self, embd: int, heads: int) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(embd)
        self.attn = _SelfAttention(embd, heads)
        self.ln_2 = nn.LayerNorm(embd)
        self.mlp = nn.Sequential(nn.Linear(embd, 4 * embd), nn.GELU(), nn.Linear(4 * embd, embd))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class MiniGPT(nn.Module):
    """nanoGPT's architecture (pre-LN blocks, learned positions, lm_head tied to the token embedding, no
    dropout): the stand-in for hetero.models.gpt until that lands, with the same forward(input_ids, labels)."""

    def __init__(self, s: ModelShape) -> None:
        super().__init__()
        self.wte = nn.Embedding(s.vocab, s.embd)
        self.wpe = nn.Embedding(s.seq, s.embd)
        self.h = nn.ModuleList(_Block(s.embd, s.heads) for _ in range(s.layers))
        self.ln_f = nn.LayerNorm(s.embd)
        self.lm_head = nn.Linear(s.embd, s.vocab, bias=False)
        self.lm_head.weight = self.wte.weight  # tied, as in nanoGPT: the engines must handle a shared parameter
        for name, p in self.named_parameters():
            if name.endswith("weight") and p.dim() == 2:
                nn.init.normal_(p, std=0.02)
            elif name.endswith("bias"):
                nn.init.zeros_(p)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> GPTOutput:
        pos = torch.arange(input_ids.shape[1], device=input_ids.device)
        x = self.wte(input_ids) + self.wpe(pos)
        for block in self.h:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        loss = None if labels is None else F.cross_entropy(logits.flatten(0, 1), labels.flatten())
        return GPTOutput(loss, logits)


def build_llama(s: ModelShape, intermediate: int) -> tuple[nn.Module, str]:
    """Hugging Face's LlamaForCausalLM at the shape (RMSNorm, rotary positions, SwiGLU; embeddings tied to the head
    as the GPT's are). With the defaults (512 wide, 6 layers, 8 heads, MLP 1312, vocabulary 8192): 22.6M
    parameters, the issue's 22.5M Llama."""
    import transformers

    cfg = transformers.LlamaConfig(
        vocab_size=s.vocab,
        hidden_size=s.embd,
        intermediate_size=intermediate,
        num_hidden_layers=s.layers,
        num_attention_heads=s.heads,
        num_key_value_heads=s.heads,
        max_position_embeddings=s.seq,
        tie_word_embeddings=True,
        use_cache=False,  # training
    )
    return transformers.LlamaForCausalLM(cfg), f"transformers LlamaForCausalLM {transformers.__version__}"


def build_model(s: ModelShape, builtin: bool = False) -> tuple[nn.Module, str]:
    """The benchmark's model and where it came from: hetero.models.gpt when importable (and not `builtin`), else
    MiniGPT."""
    if builtin:
        return MiniGPT(s), "builtin MiniGPT"
    try:
        from hetero.models.gpt import GPT, GPTConfig  # type: ignore[import-not-found]
    except ImportError:
        return MiniGPT(s), "builtin MiniGPT (hetero.models.gpt not importable)"
    wanted: dict[str, Any] = dict(
        vocab_size=s.vocab, n_layer=s.layers, n_head=s.heads, n_embd=s.embd, block_size=s.seq, dropout=0.0
    )
    # Pass only the fields this GPTConfig has: dropout must be 0 where it exists (ranks draw different masks).
    fields = {f.name for f in dataclasses.fields(GPTConfig)} if dataclasses.is_dataclass(GPTConfig) else set(wanted)
    return GPT(GPTConfig(**{k: v for k, v in wanted.items() if k in fields})), "hetero.models.gpt"


def _blocks(model: nn.Module, layers: int) -> list[nn.Module]:
    """The transformer blocks: the ModuleList of `layers` modules (its name differs between GPT versions)."""
    for m in model.modules():
        if isinstance(m, nn.ModuleList) and len(m) == layers:
            return list(m)
    raise RuntimeError(f"no nn.ModuleList of {layers} blocks found in {type(model).__name__}")


def global_batch(step: int, sequences: int, s: ModelShape, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The step's whole batch, the same in every configuration and rank (a rank then takes its rows).

    Tokens follow a fixed random permutation of the previous token half of the time and a Zipf-like draw
    otherwise, so there is something to learn and the loss falls within a few steps: diverging trajectories
    between configurations show in the final loss.
    """
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    perm = torch.randperm(s.vocab, generator=torch.Generator().manual_seed(seed))
    probs = 1.0 / torch.arange(1, s.vocab + 1, dtype=torch.float64) ** 1.1
    draws = torch.multinomial(probs.expand(sequences, -1), s.seq + 1, replacement=True, generator=g)
    follow = torch.rand(sequences, s.seq + 1, generator=g) < 0.5
    tokens = draws.clone()
    for t in range(1, s.seq + 1):
        tokens[:, t] = torch.where(follow[:, t], perm[tokens[:, t - 1]], draws[:, t])
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


# ------------------------------------------------------------------------------------------------ memory
def _status_kib(field: str) -> int | None:
    """A `VmXXX:` line of /proc/self/status in KiB, or None off Linux."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


class PeakRss:
    """Peak RSS of this process. VmHWM is exact and per process image; getrusage's maxrss is not used because a
    spawned child inherits the maxrss of the parent it was forked from. Without /proc, psutil is sampled."""

    def __init__(self, period_s: float = 0.02) -> None:
        self._peak = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if _status_kib("VmHWM") is None:
            self._thread = threading.Thread(target=self._sample, args=(period_s,), daemon=True)
            self._thread.start()

    def _sample(self, period_s: float) -> None:
        proc = psutil.Process()
        while not self._stop.wait(period_s):
            self._peak = max(self._peak, proc.memory_info().rss)

    def peak_mb(self) -> float:
        hwm = _status_kib("VmHWM")
        if hwm is not None:
            return hwm / 1024
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        return max(self._peak, psutil.Process().memory_info().rss) / 2**20


# ------------------------------------------------------------------------------------------------ one rank
StepFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (input_ids, labels) -> loss; one full update


def adamw(params: Any, lr: float) -> torch.optim.AdamW:
    """Every configuration's optimizer: torch's AdamW with its fused kernel (the one hetero runs on its flat shards),
    so that no peer is timed with the slower per-tensor loop."""
    return torch.optim.AdamW(params, lr=lr, fused=True)


def _setup_plain(spec: Spec, model: nn.Module) -> tuple[StepFn, Callable[[], dict[str, Any]]]:
    opt = adamw(model.parameters(), spec.lr)

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = model(input_ids=x, labels=y).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    return step, dict


def _setup_fsdp2(spec: Spec, model: nn.Module) -> tuple[StepFn, Callable[[], dict[str, Any]]]:
    from torch.distributed.device_mesh import init_device_mesh

    try:
        from torch.distributed.fsdp import fully_shard
    except ImportError:  # torch 2.4-2.5: FSDP2 under its first name
        from torch.distributed._composable.fsdp import fully_shard  # type: ignore[no-redef]

    mesh = init_device_mesh("cpu", (spec.world,))
    for block in _blocks(model, spec.shape.layers):
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)  # the root takes what the blocks left: embeddings, final norm, (tied) head
    return _setup_plain(spec, model)  # the optimizer now sees the sharded DTensor parameters


def _setup_hetero(spec: Spec, model: nn.Module) -> tuple[StepFn, Callable[[], dict[str, Any]]]:
    import hetero

    opt = adamw(model.parameters(), spec.lr)
    where = "nvme" if spec.nvme_dir else "device"
    memory: dict[str, Any] = {"nvme_dir": spec.nvme_dir} if spec.nvme_dir else {}
    offload: dict[str, Any] = {"params": where, "optimizer": where}
    if spec.nvme_dir:
        offload["params_host_bytes"] = spec.max_in_cpu * 4  # DeepSpeed's max_in_cpu, fp32 elements
    config = {
        "zero_stage": spec.stage,
        "precision": "fp32",
        "offload": offload,
        "memory": memory,
        "grad_accumulation_steps": 1,
        "delayed_param_update": spec.delayed,
        "update_in_backward": spec.in_backward,
    }
    if spec.delayed:
        config["delayed_param_update_warmup"] = 0  # the steady state is timed: delayed from the first update
    if spec.hetero_extra:
        config.update(json.loads(spec.hetero_extra))
    engine = hetero.initialize(model, opt, config)  # type: ignore[attr-defined]

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = engine(input_ids=x, labels=y).loss
        engine.backward(loss)
        engine.step()
        return loss

    def finish() -> dict[str, Any]:
        stats = engine.memory_stats()
        engine.close()
        # Whatever shape memory_stats has, keep it JSON-able (repr for anything json cannot write).
        return {"memory_stats": json.loads(json.dumps(stats, default=repr))}

    return step, finish


def _merge(into: dict[str, Any], extra: dict[str, Any]) -> None:
    """`extra`'s keys into `into`, nested objects merged key by key (so `{"zero_optimization": {"offload_optimizer":
    {"pipeline_read": true}}}` keeps the offload device and path)."""
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(into.get(key), dict):
            _merge(into[key], value)
        else:
            into[key] = value


def _setup_deepspeed(spec: Spec, model: nn.Module) -> tuple[StepFn, Callable[[], dict[str, Any]]]:
    os.environ["DS_ACCELERATOR"] = "cpu"  # read when deepspeed first picks its accelerator, i.e. on import
    import deepspeed  # type: ignore[import-not-found]

    zero: dict[str, Any] = {"stage": spec.stage}
    if spec.nvme_dir:
        zero["offload_param"] = {"device": "nvme", "nvme_path": spec.nvme_dir, "max_in_cpu": spec.max_in_cpu}
        zero["offload_optimizer"] = {"device": "nvme", "nvme_path": spec.nvme_dir}
    if spec.pipelined:
        from benchmarks.gpu_race import pipelined_swap

        pipelined_swap(zero, -(-sum(p.numel() for p in model.parameters()) // spec.world))
    config = {
        "train_micro_batch_size_per_gpu": spec.batch,
        "gradient_accumulation_steps": 1,
        "zero_optimization": zero,
        "zero_allow_untested_optimizer": True,
        "gradient_clipping": 0.0,  # DeepSpeed 0.19 clips at 1.0 unless told not to; no other configuration clips
        "steps_per_print": 1 << 30,  # keep its logging out of the timed steps
        "wall_clock_breakdown": False,
    }
    # The same torch AdamW as every other configuration, unless offloading, which needs DeepSpeed's CPU Adam.
    opt = None if spec.nvme_dir else adamw(model.parameters(), spec.lr)
    if spec.nvme_dir:
        config["optimizer"] = {"type": "AdamW", "params": {"lr": spec.lr, "weight_decay": 0.01}}
    if spec.deepspeed_extra:
        _merge(config, json.loads(spec.deepspeed_extra))
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, model_parameters=model.parameters(), config=config)

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = engine(input_ids=x, labels=y).loss
        engine.backward(loss)
        engine.step()
        return loss

    return step, dict


def _setup_floor(spec: Spec, model: nn.Module) -> tuple[StepFn, Callable[[], dict[str, Any]]]:
    """What no sharded engine can beat here: each rank's forward and backward on its own rows and the fused AdamW on
    its half of the parameters (by elements), with no communication at all. Its losses are the rank's own, not a
    data-parallel run's, and are left out of losses_agree."""
    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    params = list(model.parameters())
    total, seen, mine = sum(p.numel() for p in params), 0, []
    for p in params:
        if (seen * spec.world) // total == rank:  # the shard this rank would step, cut at parameter boundaries
            mine.append(p)
        seen += p.numel()
    opt = adamw(mine, spec.lr)
    # floor_zero3: also the least a ZeRO-3 step must send, once each: the parameters all-gathered and the gradients
    # reduce-scattered, both started before forward and waited for after backward, so that they may overlap all the
    # compute (no engine can start them earlier). Flat fp32 buffers of the model's size; the data sent is not used.
    # They go through hetero's Comm, so through the fastest CPU transport any engine here has (its cross-memory
    # reads unless spec.transport says gloo).
    comm = spec.name == "floor_zero3" and spec.world > 1
    flat = -(-total // spec.world) * spec.world if comm else 0
    full, shard = torch.zeros(flat), torch.zeros(flat // spec.world)
    grads, reduced = torch.zeros(flat), torch.zeros(flat // spec.world)
    if comm:
        from hetero.comm import Comm

        group = Comm.world()

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        sent = []
        if comm:
            sent.append(group.all_gather_async(full, shard))
            sent.append(group.reduce_scatter_async(reduced, grads))
        loss = model(input_ids=x, labels=y).loss
        loss.backward()
        for work in sent:
            work.wait()
        opt.step()
        model.zero_grad(set_to_none=True)
        return loss

    return step, dict


_SETUP = {
    "plain": _setup_plain,
    "fsdp2": _setup_fsdp2,
    "hetero": _setup_hetero,
    "deepspeed": _setup_deepspeed,
    "floor": _setup_floor,
}


def _train(spec: Spec, rank: int) -> dict[str, Any]:
    rss = PeakRss()
    base_mb = (_status_kib("VmRSS") or psutil.Process().memory_info().rss // 1024) / 1024
    torch.manual_seed(spec.seed)  # every rank builds the same initial weights
    if spec.family == "llama":
        model, source = build_llama(spec.shape, spec.intermediate)
    else:
        model, source = build_model(spec.shape, spec.builtin_model)
    params = sum(p.numel() for p in model.parameters())
    step, finish = _SETUP[spec.kind](spec, model)
    rows = slice(rank * spec.batch, (rank + 1) * spec.batch)
    times, losses, usage = [], [], []
    distributed = dist.is_available() and dist.is_initialized()
    for i in range(spec.warmup + spec.steps):
        x, y = global_batch(i, spec.batch * spec.world, spec.shape, spec.seed)
        x, y = x[rows], y[rows]
        if distributed and i == spec.warmup:
            dist.barrier()  # start the timed steps together, so a slow warm-up on one rank is not counted
        u0 = _usage()
        t0 = time.perf_counter()
        loss = step(x, y)
        times.append(time.perf_counter() - t0)
        usage.append(tuple(b - a for a, b in zip(u0, _usage())))
        losses.append(float(loss.detach()))  # the rank's mean over its rows; averaged over ranks afterwards
    extra = finish()
    return {
        "times": times[spec.warmup :],
        "usage": usage[spec.warmup :],
        "losses": losses,
        "peak_rss_mb": rss.peak_mb(),
        "rss_base_mb": base_mb,
        "params": params,
        "model": source,
        **extra,
    }


def _usage() -> tuple[float, float, int]:
    """(user CPU s, system CPU s, minor page faults) of this process so far: the work a step does, which other load
    on a shared machine disturbs far less than its wall time. Zeros where `resource` is missing (Windows)."""
    try:
        import resource
    except ImportError:
        return (0.0, 0.0, 0)
    r = resource.getrusage(resource.RUSAGE_SELF)
    return (r.ru_utime, r.ru_stime, r.ru_minflt)


def _rank_main(spec: Spec, rank: int, port: int, log_path: str, reports: Any) -> None:
    # Children's output (DeepSpeed logs a lot) goes to a log file, so --json prints exactly one object.
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(spec.world),
        LOCAL_WORLD_SIZE=str(spec.world),
        HETERO_CPU_TRANSPORT=spec.transport,
    )
    torch.set_num_threads(spec.threads)
    with contextlib.suppress(RuntimeError):  # fails only if inter-op work already started: then it is moot
        torch.set_num_interop_threads(1)
    ok = False
    try:
        if spec.world > 1:
            # A bounded timeout: a rank that dies mid-collective ends the run with an error instead of a hang.
            timeout = datetime.timedelta(seconds=120)
            dist.init_process_group("gloo", rank=rank, world_size=spec.world, timeout=timeout)
        payload = pickle.dumps(_train(spec, rank))
        ok = True
    except BaseException:
        payload = traceback.format_exc().encode()
    reports.put((rank, ok, payload))
    if dist.is_initialized():
        # Rank 0 hosts the store: leaving before the other rank is done with it would break that rank.
        with contextlib.suppress(Exception):
            dist.barrier()
        with contextlib.suppress(Exception):
            dist.destroy_process_group()


# ------------------------------------------------------------------------------------------------ driver
def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _tail(path: str, lines: int = 12) -> str:
    with contextlib.suppress(OSError), open(path, errors="replace") as f:
        return "".join(f.readlines()[-lines:])
    return ""


def run_config(spec: Spec, timeout_s: float, log_dir: str) -> list[dict[str, Any]]:
    """Run one configuration on fresh processes; the ranks' results in rank order. Raises RuntimeError with the
    failing rank's traceback (and its log's tail) if a rank fails, or if the run exceeds timeout_s."""
    try:
        return _run_once(spec, timeout_s, log_dir)
    except RuntimeError as err:
        # The port was free when picked, but another process may have taken it since: one more try.
        if "address already in use" not in str(err).lower():
            raise
        return _run_once(spec, timeout_s, log_dir)


def _run_once(spec: Spec, timeout_s: float, log_dir: str) -> list[dict[str, Any]]:
    ctx = mp.get_context("spawn")  # fork would copy the parent's torch threads and state
    reports = ctx.Queue()
    logs = [os.path.join(log_dir, f"{spec.name}.rank{r}.log") for r in range(spec.world)]
    port = _free_port()
    procs = [
        ctx.Process(target=_rank_main, args=(spec, r, port, logs[r], reports), daemon=True) for r in range(spec.world)
    ]
    results: dict[int, dict[str, Any]] = {}
    deadline = time.monotonic() + timeout_s
    try:
        for p in procs:
            p.start()
        while len(results) < spec.world:
            if time.monotonic() > deadline:
                raise RuntimeError(f"timed out after {timeout_s:.0f} s; last log lines:\n{_tail(logs[0])}")
            try:
                rank, ok, payload = reports.get(timeout=0.2)
            except queue_mod.Empty:
                dead = [r for r, p in enumerate(procs) if r not in results and not p.is_alive()]
                if dead and reports.empty():
                    time.sleep(0.5)  # its report may still be in the pipe
                    if reports.empty():
                        r = dead[0]
                        raise RuntimeError(
                            f"rank {r} exited with code {procs[r].exitcode} without reporting:\n{_tail(logs[r])}"
                        ) from None
                continue
            if not ok:
                raise RuntimeError(f"rank {rank} raised:\n{payload.decode(errors='replace')}")
            results[rank] = pickle.loads(payload)
        return [results[r] for r in range(spec.world)]
    finally:
        leave_by = time.monotonic() + 10
        for p in procs:
            if p.pid is not None:
                p.join(max(0.0, leave_by - time.monotonic()))
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(5)
        reports.close()
        reports.cancel_join_thread()


def summarize(rounds: list[list[dict[str, Any]]]) -> dict[str, Any]:
    """One configuration's figures from its rounds (each a list of the ranks' results)."""
    # A step ends when its slowest rank does. Other load on the machine only ever adds time, so of several rounds
    # the least disturbed one (the lowest median) is the best estimate of the configuration's own step time.
    steps = [[max(ts) for ts in zip(*(r["times"] for r in ranks))] for ranks in rounds]
    medians = [statistics.median(ts) for ts in steps]
    per_step = steps[medians.index(min(medians))]
    first = rounds[0]
    losses = [statistics.fmean(ls) for ls in zip(*(r["losses"] for r in first))]  # equal rows per rank
    world = len(first)
    # The work of a step, summed over ranks, median over every timed step of every round.
    work = [[sum(col) for col in zip(*us)] for ranks in rounds for us in zip(*(r["usage"] for r in ranks))]
    return {
        "cpu_s": round(statistics.median(u + k for u, k, _ in work), 4),
        "sys_s": round(statistics.median(k for _, k, _ in work), 4),
        "page_faults": int(statistics.median(f for _, _, f in work)),
        "step_s": statistics.median(per_step),
        "step_s_min": min(per_step),
        "step_s_max": max(per_step),
        "round_step_s": medians,
        "final_loss": losses[-1],
        "losses": losses,
        "peak_rss_mb": [round(max(ranks[i]["peak_rss_mb"] for ranks in rounds), 1) for i in range(world)],
        "rss_base_mb": [round(first[i]["rss_base_mb"], 1) for i in range(world)],
        "params": first[0]["params"],
        "model": first[0]["model"],
        **({"memory_stats": [r["memory_stats"] for r in first]} if "memory_stats" in first[0] else {}),
    }


def wait_idle(limit_s: float, probe_s: float = 2.0) -> bool:
    """Wait up to limit_s for the CPUs to be idle (this process and its children run nothing now, so any use is
    another process's); whether they became so."""
    deadline = time.monotonic() + limit_s
    while True:
        if psutil.cpu_percent(interval=probe_s) < BUSY_WARN_PCT / 2:
            return True
        if time.monotonic() >= deadline:
            return False


class OthersCpu:
    """The share of the machine's CPU time that other processes took while a block ran: all busy CPU time
    (steal included: another VM's use of our cores) less this process's and its waited-for children's. On a
    shared machine that share competes with the ranks, and the timings of that block are suspect."""

    def __enter__(self) -> OthersCpu:
        self.pct: float | None = None
        self._t0 = time.monotonic()
        self._sys0 = psutil.cpu_times()
        self._ours0 = self._ours()
        return self

    @staticmethod
    def _ours() -> float:
        me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
        return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime

    @staticmethod
    def _busy(t: Any) -> float:
        # guest time is already counted in user time on Linux; idle and iowait are not busy.
        skip = {"idle", "iowait", "guest", "guest_nice"}
        return sum(v for k, v in t._asdict().items() if k not in skip)

    def __exit__(self, *exc: object) -> None:
        elapsed = time.monotonic() - self._t0
        others = self._busy(psutil.cpu_times()) - self._busy(self._sys0) - (self._ours() - self._ours0)
        self.pct = max(0.0, 100 * others / (elapsed * (psutil.cpu_count() or 1))) if elapsed > 0 else None


def _first_line(err: BaseException) -> str:
    """The most telling line of a rank's error: the exception line of its traceback, not the whole trace."""
    lines = [ln for ln in str(err).splitlines() if ln.strip()]
    for ln in reversed(lines):
        if not ln.startswith((" ", "Traceback", "---")) and ("Error" in ln or "Exception" in ln or ":" in ln):
            return ln.strip()
    return lines[-1].strip() if lines else repr(err)


def hetero_missing() -> str | None:
    """Why hetero's engine cannot be benchmarked, or None when hetero.initialize exists."""
    try:
        import hetero
    except Exception as err:  # any import-time failure means the same: nothing to measure
        return f"import hetero failed: {err!r}"
    if not hasattr(hetero, "initialize"):
        return "hetero.initialize does not exist yet (the engine has not landed)"
    return None


def deepspeed_missing() -> str | None:
    """Why DeepSpeed cannot be benchmarked (checked without importing it here: that is slow and noisy)."""
    if importlib.util.find_spec("deepspeed") is None:
        return "deepspeed is not installed (optional: DS_BUILD_OPS=0 pip install deepspeed)"
    return None


def build_specs(args: argparse.Namespace) -> list[Spec]:
    shape = ModelShape(vocab=args.vocab, layers=args.layers, heads=args.heads, embd=args.embd, seq=args.seq)
    common = dict(
        shape=shape,
        steps=args.steps,
        warmup=args.warmup,
        seed=args.seed,
        lr=args.lr,
        builtin_model=args.builtin_model,
        family=args.model,
        intermediate=args.intermediate,
        hetero_extra=args.hetero_config or "",  # read by hetero's setup only
        deepspeed_extra=args.deepspeed_config or "",  # read by DeepSpeed's setup only
    )
    per_rank = TOTAL_THREADS // WORLD
    specs = [
        Spec("plain", "plain", world=1, threads=TOTAL_THREADS, batch=WORLD * args.batch, **common),
        Spec("fsdp2", "fsdp2", world=WORLD, threads=per_rank, batch=args.batch, **common),
        Spec("floor", "floor", world=WORLD, threads=per_rank, batch=args.batch, **common),
        Spec("floor_zero3", "floor", world=WORLD, threads=per_rank, batch=args.batch, **common),
    ]
    specs += [
        Spec(f"hetero_stage{k}", "hetero", world=WORLD, threads=per_rank, batch=args.batch, stage=k, **common)
        for k in range(4)
    ]
    # Like for like: hetero moving its data through gloo, the only CPU transport the peers' torch.distributed has.
    gloo = dict(world=WORLD, threads=per_rank, batch=args.batch, stage=3, transport="gloo")
    specs.append(Spec("hetero_stage3_gloo", "hetero", **gloo, **common))
    specs.append(Spec("deepspeed", "deepspeed", world=WORLD, threads=per_rank, batch=args.batch, stage=3, **common))
    if args.with_nvme:
        for kind in ("hetero", "deepspeed"):
            name = "hetero_stage3_nvme" if kind == "hetero" else "deepspeed_nvme"
            nvme = dict(stage=3, nvme_dir=os.path.abspath(args.with_nvme), max_in_cpu=args.max_in_cpu)
            specs.append(Spec(name, kind, world=WORLD, threads=per_rank, batch=args.batch, **nvme, **common))
        nvme_gloo = dict(gloo, nvme_dir=os.path.abspath(args.with_nvme), max_in_cpu=args.max_in_cpu)
        specs.append(Spec("hetero_stage3_nvme_gloo", "hetero", **nvme_gloo, **common))
        piped = dict(stage=3, nvme_dir=os.path.abspath(args.with_nvme), pipelined=True, max_in_cpu=args.max_in_cpu)
        specs.append(
            Spec(
                "deepspeed_nvme_pipelined",
                "deepspeed",
                world=WORLD,
                threads=per_rank,
                batch=args.batch,
                **piped,
                **common,
            )
        )
        ib = dict(stage=3, nvme_dir=os.path.abspath(args.with_nvme), in_backward=True, max_in_cpu=args.max_in_cpu)
        specs.append(
            Spec("hetero_stage3_nvme_ib", "hetero", world=WORLD, threads=per_rank, batch=args.batch, **ib, **common)
        )
        dpu = dict(stage=3, nvme_dir=os.path.abspath(args.with_nvme), delayed=True, max_in_cpu=args.max_in_cpu)
        specs.append(
            Spec("hetero_stage3_nvme_dpu", "hetero", world=WORLD, threads=per_rank, batch=args.batch, **dpu, **common)
        )
    return specs


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", action="store_true", help="print exactly one JSON object instead of text")
    ap.add_argument("--steps", type=int, default=10, help="timed steps per configuration (default 10)")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps first (default 3)")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--embd", type=int, default=256)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=8, help="sequences per rank; plain PyTorch runs 2x this")
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--with-nvme", metavar="DIR", help="also run hetero stage 3 and DeepSpeed with NVMe offload")
    ap.add_argument(
        "--max-in-cpu",
        type=int,
        default=10**9,
        metavar="N",
        help="*_nvme: parameter elements both engines keep in host memory (default DeepSpeed's 1e9; 0: none)",
    )
    ap.add_argument("--only", help="comma-separated configuration names to run (default: all)")
    ap.add_argument("--rounds", type=int, default=1, help="run every configuration this many times (noisy hosts)")
    ap.add_argument(
        "--wait-idle", type=float, default=0, metavar="S", help="wait up to S s for an idle machine before each run"
    )
    ap.add_argument("--timeout", type=float, default=240, help="seconds one configuration may take")
    ap.add_argument("--builtin-model", action="store_true", help="this file's MiniGPT, not hetero.models.gpt")
    ap.add_argument(
        "--model", choices=("gpt", "llama"), default="gpt", help="llama: transformers' LlamaForCausalLM at the shape"
    )
    ap.add_argument("--intermediate", type=int, default=1312, help="the Llama's MLP width (--model llama)")
    ap.add_argument(
        "--hetero-config",
        metavar="JSON",
        help="extra hetero config keys for every hetero configuration, e.g. '{\"check_collectives\": false}'",
    )
    ap.add_argument(
        "--deepspeed-config",
        metavar="JSON",
        help="merged into every DeepSpeed configuration's config, nested objects key by key, e.g. "
        '\'{"zero_optimization": {"sub_group_size": 2000000}}\'',
    )
    ap.add_argument("--keep-logs", metavar="DIR", help="keep each rank's output (logs, warnings) in DIR")
    args = ap.parse_args(argv)
    if args.steps < 1 or args.warmup < 0 or args.rounds < 1 or args.embd % args.heads:
        ap.error("need --steps >= 1, --warmup >= 0, --rounds >= 1 and --embd divisible by --heads")
    for flag, given in (("--hetero-config", args.hetero_config), ("--deepspeed-config", args.deepspeed_config)):
        if given is None:
            continue
        try:
            if not isinstance(json.loads(given), dict):
                raise ValueError("not an object")
        except ValueError as e:
            ap.error(f"{flag}: expected a JSON object of config keys ({e})")
    if args.max_in_cpu < 0:
        ap.error("--max-in-cpu: a number of parameter elements, 0 or more")
    if args.with_nvme and not os.path.isdir(args.with_nvme):
        ap.error(f"--with-nvme {args.with_nvme}: not a directory")

    specs = build_specs(args)
    if args.only:
        wanted = set(args.only.split(","))
        unknown = wanted - {s.name for s in specs}
        if unknown:
            ap.error(f"--only: unknown configuration(s) {sorted(unknown)}; known: {[s.name for s in specs]}")
        specs = [s for s in specs if s.name in wanted]
    skipped: dict[str, str] = {}
    hetero_reason = hetero_missing()
    ds_reason = deepspeed_missing()
    log = (lambda *a: None) if args.json else (lambda *a: print(*a, flush=True))
    log(
        f"GPT {args.layers} layers, embd {args.embd}, {args.heads} heads, seq {args.seq}, vocab {args.vocab}; "
        f"global batch {WORLD * args.batch} ({args.batch} per rank x {WORLD} ranks on gloo, 1 thread each; "
        f"plain: 1 process, {TOTAL_THREADS} threads); {args.warmup} warm-up + {args.steps} timed steps, fp32 AdamW"
    )
    raw: dict[str, list[list[dict[str, Any]]]] = {}  # configuration -> rounds -> ranks' results
    busy: dict[str, list[float | None]] = {}  # configuration -> CPU share other processes took, per round
    log_dir = args.keep_logs or tempfile.mkdtemp(prefix="hetero-step-time-")
    os.makedirs(log_dir, exist_ok=True)
    started = time.monotonic()
    try:
        for rnd in range(args.rounds):
            # Every other round runs backwards, so a drift in the machine's load hits all configurations alike.
            for spec in specs if rnd % 2 == 0 else specs[::-1]:
                reason = hetero_reason if spec.kind == "hetero" else ds_reason if spec.kind == "deepspeed" else None
                if reason is not None and spec.name not in skipped:
                    skipped[spec.name] = reason
                    log(f"{spec.name:20s} skipped: {reason}")
                if spec.name in skipped:
                    continue
                if args.wait_idle > 0 and not wait_idle(args.wait_idle):
                    log(f"{spec.name:20s} the machine stayed busy for {args.wait_idle:.0f} s: running it anyway")
                t0 = time.monotonic()
                try:
                    # run_config joins the ranks, so their CPU time is in RUSAGE_CHILDREN when this block ends.
                    with OthersCpu() as others:
                        ranks = run_config(spec, args.timeout, log_dir)
                except RuntimeError as err:
                    reason = _first_line(err)
                    if "async_io" in reason:
                        reason += " (DeepSpeed's NVMe offload needs its async_io op, which needs libaio: libaio-dev)"
                    skipped[spec.name] = reason
                    raw.pop(spec.name, None)
                    busy.pop(spec.name, None)
                    # The tail of the traceback says where it failed; the whole trace is in the rank's log.
                    log(f"{spec.name:20s} failed:\n" + "\n".join(str(err).splitlines()[-8:]))
                    continue
                raw.setdefault(spec.name, []).append(ranks)
                busy.setdefault(spec.name, []).append(others.pct)
                r = summarize(raw[spec.name][-1:])
                log(
                    f"{spec.name:20s} {r['step_s'] * 1e3:8.1f} ms/step (min {r['step_s_min'] * 1e3:.1f}, max "
                    f"{r['step_s_max'] * 1e3:.1f})  final loss {r['final_loss']:.4f}  peak RSS/rank "
                    f"{'/'.join(f'{m:.0f}' for m in r['peak_rss_mb'])} MB  CPU {r['cpu_s']:.2f} s/step "
                    f"(system {r['sys_s']:.2f}, {r['page_faults']} page faults)  [{time.monotonic() - t0:.0f} s"
                    + f", others used {others.pct or 0:.0f}% CPU"
                    + (f", round {rnd + 1}]" if args.rounds > 1 else "]")
                )
    finally:
        if not args.keep_logs:
            shutil.rmtree(log_dir, ignore_errors=True)

    results = {name: summarize(rounds) for name, rounds in raw.items()}
    out = report(args, results, skipped, hetero_reason)
    out["cpu_busy_by_others_pct"] = {
        name: [None if b is None else round(b, 1) for b in bs] for name, bs in busy.items()
    }
    worst = max((b for bs in busy.values() for b in bs if b is not None), default=0.0)
    out["warning"] = (
        f"other processes took up to {worst:.0f}% of the CPUs while configurations ran: timings are unreliable"
        + ("" if args.rounds > 1 else " (--rounds 3 takes the least disturbed round of each)")
        if worst > BUSY_WARN_PCT
        else None
    )
    out["wall_s"] = round(time.monotonic() - started, 1)
    if args.json:
        print(json.dumps(out))
    else:
        print_report(out)
    return 0


def _exact(name: str) -> bool:
    """Whether a configuration trains plain PyTorch's trajectory (the delayed update and the floors do not)."""
    return not name.endswith("_dpu") and not name.startswith("floor")


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else round(a / b, 4)


def report(
    args: argparse.Namespace, results: dict[str, dict[str, Any]], skipped: dict[str, str], hetero_reason: str | None
) -> dict[str, Any]:
    def step_s(name: str) -> float | None:
        return round(results[name]["step_s"], 5) if name in results else None

    any_result = next(iter(results.values()), None)
    out: dict[str, Any] = {
        "model": any_result["model"] if any_result else None,
        "params": any_result["params"] if any_result else None,
        "layers": args.layers,
        "embd": args.embd,
        "heads": args.heads,
        "seq": args.seq,
        "vocab": args.vocab,
        "world_size": WORLD,
        "per_rank_batch": args.batch,
        "global_batch": WORLD * args.batch,
        "threads_per_rank": TOTAL_THREADS // WORLD,
        "plain_threads": TOTAL_THREADS,
        "steps": args.steps,
        "warmup": args.warmup,
        "max_in_cpu": args.max_in_cpu if args.with_nvme else None,
        "torch": torch.__version__,
        "plain_step_s": step_s("plain"),
        "fsdp2_step_s": step_s("fsdp2"),
        "floor_step_s": step_s("floor"),
        "floor_zero3_step_s": step_s("floor_zero3"),
    }
    plain, fsdp2 = out["plain_step_s"], out["fsdp2_step_s"]
    out["fsdp2_vs_plain"] = _ratio(fsdp2, plain)
    for k in range(4):
        h = out[f"hetero_stage{k}_step_s"] = step_s(f"hetero_stage{k}")
        out[f"hetero_stage{k}_vs_plain"] = _ratio(h, plain)
        out[f"hetero_stage{k}_vs_fsdp2"] = _ratio(h, fsdp2)
    out["hetero_error"] = hetero_reason or next((v for k, v in skipped.items() if k.startswith("hetero")), None)
    ds = out["deepspeed_step_s"] = step_s("deepspeed")
    out["deepspeed_skipped_reason"] = skipped.get("deepspeed")
    out["hetero_stage3_vs_deepspeed"] = _ratio(out["hetero_stage3_step_s"], ds)
    if args.with_nvme:
        nvme_names = ("hetero_stage3_nvme", "hetero_stage3_nvme_ib", "hetero_stage3_nvme_dpu")
        for name in (*nvme_names, *DS_NVME):
            out[f"{name}_step_s"] = step_s(name)
            out[f"{name}_skipped_reason"] = skipped.get(name)
    out["races"] = races(results)
    out["floor_vs_fsdp2"] = _ratio(out["floor_step_s"], fsdp2)
    out["floor_zero3_vs_fsdp2"] = _ratio(out["floor_zero3_step_s"], fsdp2)
    h3 = out["hetero_stage3_step_s"]
    out["targets"] = {
        "hetero_stage3_vs_fsdp2_max": TARGET_VS_FSDP2,
        "hetero_stage3_vs_plain_max": TARGET_VS_PLAIN,
        "met": None
        if None in (h3, fsdp2, plain)
        else bool(h3 <= TARGET_VS_FSDP2 * fsdp2 and h3 <= TARGET_VS_PLAIN * plain),
    }
    out["peak_rss_mb"] = {name: r["peak_rss_mb"] for name, r in results.items()}
    out["rss_base_mb"] = {name: r["rss_base_mb"] for name, r in results.items()}
    out["final_loss"] = {name: round(r["final_loss"], 5) for name, r in results.items()}
    ref = results.get("plain") or results.get("fsdp2")
    if ref is not None:
        # Largest per-step loss gap to plain PyTorch (FSDP2 without it): small (float rounding) unless an engine
        # trains differently. The delayed update trains another trajectory on purpose (one step stale).
        out["max_loss_diff_vs_plain"] = {
            name: round(max(abs(a - b) for a, b in zip(r["losses"], ref["losses"])), 6) for name, r in results.items()
        }
        exact = {n: g for n, g in out["max_loss_diff_vs_plain"].items() if _exact(n)}
        out["losses_agree"] = all(gap <= LOSS_TOLERANCE for gap in exact.values())
    out["round_step_s"] = {name: [round(t, 5) for t in r["round_step_s"]] for name, r in results.items()}
    for key in ("cpu_s", "sys_s", "page_faults"):  # per step, summed over ranks (see `_usage`)
        out[f"{key}_per_step"] = {name: r[key] for name, r in results.items()}
    out["skipped"] = skipped
    out["hetero_memory_stats"] = {n: r["memory_stats"] for n, r in results.items() if "memory_stats" in r}
    return out


# (name, ours, theirs, step time target, peak RSS target): the races, ours / theirs at most the targets.
# Where theirs names several configurations of the peer, its best on each measure counts.
DS_NVME = ("deepspeed_nvme", "deepspeed_nvme_pipelined")
RACES = (
    ("vs_fsdp2", "hetero_stage3", "fsdp2", 0.85, 1.0),
    ("vs_deepspeed_nvme", "hetero_stage3_nvme", DS_NVME, 0.75, 0.5),
    ("vs_deepspeed_nvme_in_backward", "hetero_stage3_nvme_ib", DS_NVME, None, None),
    # hetero on gloo as the peers are: how much of the lead is the cross-memory transport (benchmarks/README.md).
    ("vs_fsdp2_on_gloo", "hetero_stage3_gloo", "fsdp2", None, None),
    ("vs_deepspeed_nvme_on_gloo", "hetero_stage3_nvme_gloo", DS_NVME, None, None),
    ("delayed_update", "hetero_stage3_nvme_dpu", "hetero_stage3_nvme", None, None),
)


def races(results: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Each race's ratios, measured in this run: median step time, and peak RSS summed over the ranks."""
    out = {}
    for name, ours, peers, step_target, rss_target in RACES:
        ran = [p for p in ((peers,) if isinstance(peers, str) else peers) if p in results]
        if ours not in results or not ran:
            continue
        theirs = min(ran, key=lambda p: results[p]["step_s"])  # the peer's fastest; its smallest for memory
        smallest = min(ran, key=lambda p: sum(results[p]["peak_rss_mb"]))
        a, b = results[ours], results[theirs]
        step = round(a["step_s"] / b["step_s"], 4)
        rss = round(sum(a["peak_rss_mb"]) / sum(results[smallest]["peak_rss_mb"]), 4)
        met = None
        if step_target is not None:
            met = step <= step_target and rss <= rss_target
        # The floors' steps over theirs: above the step target, no engine could meet it on this machine.
        floor = round(results["floor"]["step_s"] / b["step_s"], 4) if "floor" in results else None
        floor3 = round(results["floor_zero3"]["step_s"] / b["step_s"], 4) if "floor_zero3" in results else None
        lowest = floor3 if floor3 is not None else floor
        out[name] = {
            "ours": ours,
            "theirs": theirs,
            "theirs_rss": smallest,
            "step_ratio": step,
            "rss_ratio": rss,
            # The work of a step against the same peer's (CPU seconds summed over ranks): information, no target.
            "cpu_ratio": round(a["cpu_s"] / b["cpu_s"], 4) if b["cpu_s"] else None,
            "step_target": step_target,
            "rss_target": rss_target,
            "met": met,
            "floor_ratio": floor,
            "floor_zero3_ratio": floor3,
            "step_target_below_floor": None if lowest is None or step_target is None else lowest > step_target,
        }
    return out


def print_report(out: dict[str, Any]) -> None:
    print(f"\nmodel: {out['model']}, {out['params'] / 1e6:.2f} M parameters" if out["params"] else "\nno results")
    if out["max_in_cpu"] is not None:
        print(f"*_nvme: up to {out['max_in_cpu']:.3g} parameter elements kept in host memory by both engines")
    print(f"{'configuration':20s} {'ms/step':>9s} {'vs plain':>9s} {'vs fsdp2':>9s} {'final loss':>11s}  peak RSS MB")
    plain, fsdp2 = out["plain_step_s"], out["fsdp2_step_s"]
    for name, loss in out["final_loss"].items():
        s = out[f"{name}_step_s"]
        vp, vf = _ratio(s, plain), _ratio(s, fsdp2)
        rss = "/".join(f"{m:.0f}" for m in out["peak_rss_mb"][name])
        print(
            f"{name:20s} {s * 1e3:9.1f} {'-' if vp is None else f'{vp:.3f}':>9s} "
            f"{'-' if vf is None else f'{vf:.3f}':>9s} {loss:11.4f}  {rss}"
        )
    for name, reason in out["skipped"].items():
        print(f"{name:20s} not measured: {reason}")
    if out["hetero_error"] and out["hetero_stage3_step_s"] is None:
        print(f"hetero not available: {out['hetero_error']}")
    t = out["targets"]
    if t["met"] is not None:
        print(
            f"hetero stage 3: {out['hetero_stage3_vs_fsdp2']:.3f}x FSDP2 (target <= {TARGET_VS_FSDP2}), "
            f"{out['hetero_stage3_vs_plain']:.3f}x plain (target <= {TARGET_VS_PLAIN}): "
            f"{'met' if t['met'] else 'NOT met'}"
        )
    for name, r in out["races"].items():
        target = (
            ""
            if r["met"] is None
            else (f" (targets <= {r['step_target']} and <= {r['rss_target']}: {'met' if r['met'] else 'NOT met'})")
        )
        print(
            f"race {name}: {r['ours']} / {r['theirs']}: step time {r['step_ratio']:.3f}x, "
            f"peak RSS (sum of ranks) {r['rss_ratio']:.3f}x"
            + ("" if r["theirs_rss"] == r["theirs"] else f" (/ {r['theirs_rss']})")
            + target
        )
        if r["cpu_ratio"] is not None:
            print(f"     CPU seconds a step (the work, summed over ranks) / {r['theirs']}: {r['cpu_ratio']:.3f}x")
        below = " (the step target lies below it)" if r["step_target_below_floor"] else ""
        if r["floor_ratio"] is not None:
            floor = f"{r['floor_ratio']:.3f}x" + ("" if r["floor_zero3_ratio"] is not None else below)
            print(f"     floor (each rank's compute alone, no communication) / {r['theirs']}: {floor}")
        if r["floor_zero3_ratio"] is not None:
            floor = f"{r['floor_zero3_ratio']:.3f}x{below}"
            print(f"     floor_zero3 (the same and one all-gather, one reduce-scatter) / {r['theirs']}: {floor}")
    # The delayed update and the floor train other trajectories on purpose: only the exact runs must agree.
    gaps = {n: g for n, g in out.get("max_loss_diff_vs_plain", {}).items() if _exact(n)}
    if gaps:
        worst = max(gaps, key=gaps.get)
        agree = "within" if out["losses_agree"] else "NOT within"
        print(f"largest per-step loss gap to plain PyTorch: {gaps[worst]:.2e} ({worst}), {agree} {LOSS_TOLERANCE}")
    if out["warning"]:
        print(f"WARNING: {out['warning']}")
    print(f"whole run: {out['wall_s']:.0f} s")


if __name__ == "__main__":
    sys.exit(main())
