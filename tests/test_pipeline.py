"""Pipeline parallelism: schedules as action lists, stage splitting, config errors, and training parity of
`train_batch` (pipeline schedules, micro-batches, data parallel, ZeRO 0-3 with offload) with plain PyTorch."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import hetero
from hetero.errors import ConfigError
from hetero.parallel.evaluation import forward_programs
from hetero.parallel.mesh import check_degrees
from hetero.parallel.pipeline import balance
from hetero.parallel.pipeline import chimera as C
from hetero.parallel.pipeline import schedule as S
from hetero.parallel.pipeline.split import boundaries, keep_stages, units_of
from tests.dist import NEEDS_DEGREES, ranks_apart

try:
    from tests import parity, pipe_parity, tolerance
    from tests.dist import run_distributed
except ImportError:  # tests/ itself on sys.path
    import parity  # type: ignore[no-redef]
    import pipe_parity  # type: ignore[no-redef]
    import tolerance  # type: ignore[no-redef]
    from dist import run_distributed  # type: ignore[no-redef]

LAYOUTS = [("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", 2), ("interleaved_1f1b", 3)]


# ---- schedules ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name,v", LAYOUTS)
@pytest.mark.parametrize("p,m", [(1, 3), (2, 2), (2, 4), (4, 4), (4, 8), (3, 9)])
def test_schedule_is_complete_ordered_and_deadlock_free(name, v, p, m):
    if name == "interleaved_1f1b" and m % p:
        pytest.skip("interleaved needs m % p == 0")
    lists = [S.build(name, p, m, r, v) for r in range(p)]
    for actions in lists:
        # every (micro-batch, chunk) forward and backward exactly once, each forward before its backward
        assert sorted((a.kind, a.microbatch, a.chunk) for a in actions) == sorted(
            (k, i, c) for k in "FB" for i in range(m) for c in range(v)
        )
        pos = {(a.kind, a.microbatch, a.chunk): i for i, a in enumerate(actions)}
        assert all(pos[("F", i, c)] < pos[("B", i, c)] for i in range(m) for c in range(v))
        # forwards of a chunk go in micro-batch order (what the receiving stage expects)
        for c in range(v):
            order = [a.microbatch for a in actions if a.kind == "F" and a.chunk == c]
            assert order == sorted(order)
    sim = S.simulate(p, lists, v)  # raises on a deadlock
    if name == "1f1b":
        assert sim.peak_in_flight == [min(p - r, m) for r in range(p)]  # never more than p micro-batches alive
        assert max(sim.peak_in_flight) <= p
    if name == "gpipe":
        assert sim.peak_in_flight == [m] * p


@pytest.mark.parametrize("name,v", LAYOUTS + [("interleaved_1f1b", 4)])
@pytest.mark.parametrize("p,m", [(2, 2), (2, 6), (3, 6), (4, 4), (4, 8), (4, 16), (8, 16)])
def test_transfers_cannot_deadlock_when_sends_wait_for_receives(name, p, m, v):
    progs = S.programs(name, p, m, v)
    S.check_rendezvous(progs)  # NCCL's worst case: every send waits until its receive is posted; orders agree
    # the programs hold exactly the schedule's actions, and every message is sent once and received once
    for r in range(p):
        assert [a for a in progs[r] if isinstance(a, S.Action)] == S.build(name, p, m, r, v)
    sent = sorted(
        (r, peer, msg) for r in range(p) for x in progs[r] if isinstance(x, S.Exchange) for peer, msg in x.sends
    )
    got = sorted(
        (peer, r, msg) for r in range(p) for x in progs[r] if isinstance(x, S.Exchange) for peer, msg in x.recvs
    )
    assert sent == got and len(set(sent)) == len(sent)
    assert len(sent) == sum(1 for r in range(p) for a in S.build(name, p, m, r, v) if S.transfers(a, p, r, v)[1])


def test_interleaved_steps_are_what_keeps_it_from_deadlocking():
    p, m, v = 2, 4, 2
    # each action a step of its own: the ring's activation and gradient sends cross and wait for each other
    flat = [S.program(S.build("interleaved_1f1b", p, m, r, v), p, r, v) for r in range(p)]
    with pytest.raises(RuntimeError, match="deadlock"):
        S.check_rendezvous(flat)
    steps = S.interleaved_steps(p, m, 0, v)
    assert [len(s) for s in steps] == [1, 1, 1, 1, 2, 2, 2, 2, 1, 1, 1, 1]  # warm-up, (F, B) pairs, cool-down
    S.check_rendezvous(S.programs("interleaved_1f1b", p, m, v))


def test_1f1b_steady_state_needs_sends_and_receives_in_one_group():
    p, m = 2, 4
    progs = S.programs("1f1b", p, m)
    both = [x for x in progs[0] if isinstance(x, S.Exchange) and x.sends and x.recvs]
    assert both  # forward send + backward receive on one link, mirrored on the peer
    apart = []
    for prog in progs:  # every exchange split, sends first: "send mine, then receive yours" on both sides
        out = []
        for x in prog:
            if isinstance(x, S.Exchange) and x.sends and x.recvs:
                out += [S.Exchange(x.sends, ()), S.Exchange((), x.recvs)]
            else:
                out.append(x)
        apart.append(out)
    with pytest.raises(RuntimeError, match="deadlock"):
        S.check_rendezvous(apart)


def test_exchanges_that_wait_on_their_own_payload_are_split():
    # GPipe's last forward sends its activation and would receive the first gradient in the same exchange; the
    # gradient needs that activation's payload, which goes only after the headers: merged, it deadlocks.
    p, m = 2, 2
    merged = [S.program(S.build_steps("gpipe", p, m, r), p, r) for r in range(p)]
    with pytest.raises(RuntimeError, match="deadlock"):
        S.check_rendezvous(merged)
    progs = S.programs("gpipe", p, m)
    S.check_rendezvous(progs)
    assert sum(isinstance(x, S.Exchange) for x in progs[0]) == sum(isinstance(x, S.Exchange) for x in merged[0]) + 1


def test_orders_on_a_link_must_agree():
    a, b = S.Exchange(((1, (0, 0, 1)), (1, (0, 1, 1))), ()), S.Exchange((), ((0, (0, 1, 1)), (0, (0, 0, 1))))
    with pytest.raises(RuntimeError, match="orders differ"):
        S.check_rendezvous([[a], [b]])


@pytest.mark.parametrize("name,v", LAYOUTS)
def test_simulated_bubble_matches_theory(name, v):
    p, m = 4, 8
    sim = S.simulate(p, [S.build(name, p, m, r, v) for r in range(p)], v, t_f=1.0, t_b=1.0)
    exact = (p - 1) / (v * m + p - 1)  # equal forward and backward: (p - 1) idle slots of v * m per rank
    assert sim.idle_fraction == pytest.approx(exact)
    assert sim.idle_fraction == pytest.approx(S.theory_bubble(name, p, m, v), rel=0.25)


# ---- Chimera -----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("p,m", [(2, 2), (2, 6), (4, 4), (4, 8), (6, 12), (8, 8), (8, 32)])
def test_chimera_schedule_matches_the_paper(p, m):
    """Each rank holds stage r (down) and p - 1 - r (up); ranks r and p - 1 - r mirror each other; the programs
    replay free of deadlock under NCCL's worst case; on unit slots the bubble is the paper's (p - 2) / (2m + p - 2),
    with at most p micro-batches in flight, below 1F1B's (p - 1) / (m + p - 1)."""
    half = m // 2
    lists = [S.build("chimera", p, m, r) for r in range(p)]
    for r, actions in enumerate(lists):
        assert sorted((a.kind, a.microbatch) for a in actions) == sorted((k, i) for k in "FB" for i in range(m))
        assert all(S.stage(a, p, r) == (p - 1 - r if a.microbatch >= half else r) for a in actions)
        assert all(a.chunk == int(a.up) == int(a.microbatch >= half) for a in actions)
        pos = {(a.kind, a.microbatch): i for i, a in enumerate(actions)}
        assert all(pos[("F", i)] < pos[("B", i)] for i in range(m))

        def seq(rank: int) -> list:
            return [(a.kind, S.stage(a, p, rank), a.microbatch % half) for a in lists[rank]]

        assert seq(r) == seq(p - 1 - r)  # the two replicas of a stage meet ZeRO's collectives in the same order
    progs = S.programs("chimera", p, m)
    S.check_rendezvous(progs)
    assert [[x for x in prog if isinstance(x, S.Action)] for prog in progs] == lists
    sim = S.simulate_programs(p, progs, t_f=1.0, t_b=1.0)
    assert sim.idle_fraction == pytest.approx(C.bubble(p, m), abs=1e-12)
    assert C.bubble(p, m) == S.theory_bubble("chimera", p, m) == (p - 2) / (2 * m + p - 2)
    assert max(sim.peak_in_flight) <= p
    one = S.simulate(p, [S.build("1f1b", p, m, r) for r in range(p)], t_f=1.0, t_b=1.0)
    assert sim.idle_fraction < one.idle_fraction


def test_chimera_needs_its_exchanges_in_rounds():
    """One exchange per step, as the other schedules use, mismatches a link's order or deadlocks for Chimera."""
    p, m = 4, 8
    per_step = [S.program(S.build_steps("chimera", p, m, r), p, r) for r in range(p)]
    with pytest.raises(RuntimeError, match="deadlock|orders differ"):
        S.check_rendezvous(per_step)
    S.check_rendezvous(C.chimera_programs(p, m))


def test_chimera_errors():
    with pytest.raises(ValueError, match="even number"):
        C.check(3, 6)
    with pytest.raises(ValueError, match="multiple of the pipeline stages"):
        C.check(4, 6)
    with pytest.raises(ConfigError, match="'chimera' needs an even parallel.pipeline"):
        hetero.Config.from_dict({"parallel": {"pipeline": 3, "schedule": "chimera", "microbatches": 6}})
    with pytest.raises(ConfigError, match="microbatches a multiple of it"):
        hetero.Config.from_dict({"parallel": {"pipeline": 4, "schedule": "chimera", "microbatches": 6}})
    with pytest.raises(ConfigError, match="needs schedule 'interleaved_1f1b'"):
        hetero.Config.from_dict(
            {"parallel": {"pipeline": 2, "schedule": "chimera", "microbatches": 2, "virtual_stages": 2}}
        )
    model = pipe_parity.build()
    chunks = keep_stages(model, rank=1, ranks=4, virtual=1, split="params", bidirectional=True)
    assert [c.index for c in chunks] == [1, 2]  # stage r down, stage p - 1 - r up
    assert [n for c in chunks for n, _ in c.units] == ["layers.0", "layers.1"]


@pytest.mark.parametrize("p,m,v,bi", [(2, 2, 1, False), (4, 8, 1, False), (4, 8, 2, False), (4, 8, 3, False),
                                      (2, 2, 1, True), (4, 4, 1, True), (4, 8, 1, True), (8, 16, 1, True)])  # fmt: skip
def test_forward_only_programs_are_free_of_deadlock(p, m, v, bi):
    """eval_batch's programs: every micro-batch through every stage once, in order; Chimera's ranks mirrored."""
    progs = forward_programs(p, m, v, bi)
    S.check_rendezvous([list(x) for x in progs])
    actions = [[a for a in prog if isinstance(a, S.Action)] for prog in progs]
    for r in range(p):
        assert all(a.kind == "F" for a in actions[r])
        assert sorted((a.microbatch, S.stage(a, p, r)) for a in actions[r]) == sorted(
            (i, (p - 1 - r if i >= m // 2 else r) if bi else c * p + r) for i in range(m) for c in range(v)
        )
        if bi:
            assert [S.stage(a, p, r) for a in actions[r]] == [S.stage(a, p, p - 1 - r) for a in actions[p - 1 - r]]


def test_1f1b_order_on_the_first_stage():
    assert [repr(a) for a in S.one_f_one_b(3, 4, 0)] == ["F0", "F1", "F2", "B0", "F3", "B1", "B2", "B3"]
    assert [repr(a) for a in S.one_f_one_b(3, 4, 2)] == ["F0", "B0", "F1", "B1", "F2", "B2", "F3", "B3"]


def test_schedule_errors():
    with pytest.raises(ValueError, match="multiple of stages"):
        S.interleaved_1f1b(2, 3, 0, 2)
    with pytest.raises(ValueError, match="not a pipeline rank"):
        S.gpipe(2, 2, 2)
    with pytest.raises(RuntimeError, match="deadlocks"):
        # both ranks wait for the other's backward first
        S.simulate(2, [[S.Action("F", 0), S.Action("B", 0)], [S.Action("B", 0), S.Action("F", 0)]])


# ---- splitting ---------------------------------------------------------------------------------------------------
def test_units_and_balanced_split():
    model = pipe_parity.build()
    names = [n for n, _ in units_of(model)]
    assert names == ["embed", "layers.0", "layers.1", "head"]
    assert boundaries(units_of(model), 2, "params") == [0, 2]  # embed+block | block+head: the blocks dominate
    assert boundaries(units_of(model), 2, ["layers.1"]) == [0, 2]
    seq = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 400), nn.Linear(400, 4))
    assert boundaries(units_of(seq), 2, "params") == [0, 3]
    # by cost: a costly first unit stands alone
    assert boundaries(units_of(model), 2, "auto", [9.0, 1.0, 1.0, 1.0]) == [0, 1]
    names = [n for n, _ in units_of(model)]
    assert balance.given_costs(names, {"embed": 9, "layers.*": 2}) == [9.0, 2.0, 2.0, 1.0]
    with pytest.raises(ConfigError, match="3 costs for 4 units"):
        boundaries(units_of(model), 2, "auto", [1.0, 1.0, 1.0])


class _Slow(nn.Module):
    """A unit whose forward waits: what the warm-up timing must see."""

    def __init__(self, width: int, wait: float) -> None:
        super().__init__()
        self.lin, self.wait = nn.Linear(width, width), wait

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        import time

        time.sleep(self.wait)
        return self.lin(x)


def test_auto_split_times_the_units():
    """ "auto" times each unit on the device and balances time, not parameters: a heavy but fast unit and a light
    but slow one. The random state is left as it was; on meta the units' FLOPs stand in."""
    from hetero.comm import Comm
    from hetero.device import Device

    model = nn.Sequential(nn.Linear(16, 4096), nn.Linear(4096, 16), nn.Linear(16, 16), _Slow(16, 0.05))
    units = units_of(model)
    torch.manual_seed(5)
    before = torch.get_rng_state()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # on a loaded machine, intra-op threads wait on each other for tens of ms
    try:
        costs, basis = balance.unit_costs(model, units, given=None, world=Comm(), device=Device("cpu"))
    finally:
        torch.set_num_threads(threads)
    assert basis == "timed" and torch.equal(torch.get_rng_state(), before)
    assert costs[3] > 0.045 and costs[3] > sum(costs[:3])
    assert boundaries(units, 2, "auto", costs) == [0, 3]  # the slow unit alone
    assert boundaries(units, 2, "params") == [0, 1]  # by parameters: the two heavy ones apart
    assert all(p.grad is None for p in model.parameters())
    with torch.device("meta"):
        meta = pipe_parity.build()
    flops, basis = balance.unit_costs(meta, units_of(meta), given=None, world=Comm(), device=Device("cpu"))
    assert basis == "flops" and flops[1] == flops[2] > flops[0]
    given, basis = balance.unit_costs(meta, units_of(meta), given=[1, 2, 3, 4], world=Comm(), device=Device("cpu"))
    assert (given, basis) == ([1.0, 2.0, 3.0, 4.0], "given")
    odd = nn.Sequential(nn.ReLU(), nn.Linear(4, 4))
    assert balance.unit_costs(odd, units_of(odd), given=None, world=Comm(), device=Device("cpu"))[0] is None


def test_keep_stages_drops_other_stages_and_keeps_names():
    model = pipe_parity.build()
    full = {k: v.clone() for k, v in model.state_dict().items()}
    chunks = keep_stages(model, rank=1, ranks=2, virtual=2, split="auto")  # stages: embed | l0 | l1 | head
    assert [c.index for c in chunks] == [1, 3]
    assert [n for c in chunks for n, _ in c.units] == ["layers.0", "head"]
    kept = model.state_dict()
    assert sorted(kept) == sorted(k for k in full if k.startswith(("layers.0.", "head.")))
    assert all(torch.equal(kept[k], full[k]) for k in kept)
    x = torch.randn(2, 5, 32)
    out = chunks[1](x, torch.zeros(2, 5, dtype=torch.long))
    assert out.loss.ndim == 0


def test_split_errors():
    model = pipe_parity.build()
    with pytest.raises(ConfigError, match="did you mean 'layers.1'"):
        boundaries(units_of(model), 2, ["layer.1"])
    with pytest.raises(ConfigError, match="must come after"):
        boundaries(units_of(model), 3, ["layers.1", "layers.0"])
    with pytest.raises(ConfigError, match="at least 8 units"):
        boundaries(units_of(model), 8, "auto")
    tied = pipe_parity.build()
    tied.layers[0].attn.q_proj.weight = tied.embed.tok.weight  # stages 0 and 1 of 4: Chimera holds them apart
    with pytest.raises(ConfigError, match="Chimera places on different pairs"):
        keep_stages(tied, rank=0, ranks=4, virtual=1, split="params", bidirectional=True)


def _pipelined_gpt(rank: int, world: int) -> str:
    from hetero.models import GPT, GPTConfig

    model = GPT(GPTConfig(vocab_size=64, n_layer=2, n_head=2, n_embd=32, block_size=16))
    try:
        hetero.initialize(model, None, {"parallel": {"pipeline": 2, "microbatches": 2}})
    except ConfigError as e:
        return str(e)
    return "initialized"


@ranks_apart(NEEDS_DEGREES)
@pytest.mark.timeout(120)
def test_a_model_whose_children_do_not_chain_is_named():
    """hetero's own GPT adds its position embedding beside the token one: cut by its children, the position embedding
    was fed the token embedding's output (initialize failed in the balancer on an embedding of float indices, or with
    a split given, in the first batch). Refused on every rank, naming GPTPipe."""
    for msg in run_distributed(_pipelined_gpt, 2, timeout=100):
        assert "build hetero.models.gpt_pipe.GPTPipe" in msg, msg


def test_parallel_config_errors():
    def cfg(**parallel):
        return hetero.Config.from_dict({"parallel": parallel})

    assert cfg(pipeline=2, schedule="interleaved_1f1b", microbatches=4).parallel.virtual_stages == 2
    assert cfg(pipeline_split=["layers.1"], pipeline=2).parallel.pipeline_split == ("layers.1",)
    with pytest.raises(ConfigError, match="did you mean 'interleaved_1f1b'"):
        cfg(schedule="interleaved")
    with pytest.raises(ConfigError, match="did you mean 'parallel.pipeline'"):
        cfg(pipelines=2)
    with pytest.raises(ConfigError, match="needs schedule 'interleaved_1f1b'"):
        cfg(virtual_stages=2)
    with pytest.raises(ConfigError, match="multiple of parallel.pipeline"):
        cfg(pipeline=2, schedule="interleaved_1f1b", microbatches=3)
    with pytest.raises(ConfigError, match="names 2 FQNs"):
        cfg(pipeline=2, pipeline_split=["layers.0", "layers.1"])
    with pytest.raises(ConfigError, match="set tensor > 1"):
        cfg(sequence=True)
    with pytest.raises(ConfigError, match="integer >= 1"):
        cfg(microbatches=0)
    with pytest.raises(ConfigError, match='expected "auto", "params" or a list'):
        cfg(pipeline_split="time")
    with pytest.raises(ConfigError, match="pipeline_costs balances pipeline_split"):
        cfg(pipeline_split="params", pipeline_costs=[1.0])
    with pytest.raises(ConfigError, match="number > 0"):
        cfg(pipeline_costs={"layers.*": -1})
    assert cfg(pipeline_costs=[1, 2]).parallel.pipeline_costs == (1.0, 2.0)
    with pytest.raises(ConfigError, match=r"tensor \(2\) x pipeline \(2\) = 4 must divide the world size \(6\)"):
        check_degrees(6, tensor=2, pipeline=2)
    assert check_degrees(8, tensor=2, pipeline=2) == 2


def test_bad_layouts_at_initialize():
    model = pipe_parity.build()
    with pytest.raises(ConfigError, match="must divide the world size"):
        hetero.initialize(model, parity.make_optimizer(model), {"parallel": {"pipeline": 2}})


# ---- training parity ---------------------------------------------------------------------------------------------
def test_microbatches_single_process_matches_whole_batch():
    """train_batch with 2 micro-batches (ZeRO-3: gradients summed over the batch, one reduction) and with one (the
    backward-compatible path) both train like the plain loop on the whole batch."""
    for config in ({"zero_stage": 3, "parallel": {"microbatches": 2}}, {"zero_stage": 0}):
        pipe_parity.check([pipe_parity.run(0, 1, config)])


def _matrix(rank: int, world: int, configs: list[dict]) -> list[dict]:
    torch.set_num_threads(1)
    return [pipe_parity.run(rank, world, c) for c in configs]


def _p(stage: int = 0, **parallel) -> dict:
    return {"zero_stage": stage, "parallel": parallel}


WORLD2 = {
    "pp2-gpipe-clip": {**_p(0, pipeline=2, schedule="gpipe", microbatches=2), "grad_clip_norm": 0.5},
    "pp2-1f1b-zero1": _p(1, pipeline=2, schedule="1f1b", microbatches=4),
    "pp2-interleaved-zero2": _p(2, pipeline=2, schedule="interleaved_1f1b", microbatches=4),
    "pp2-1f1b-zero3-offload": {
        **_p(3, pipeline=2, schedule="1f1b", microbatches=2),
        "offload": {"params": "host", "optimizer": "host"},
    },
    "dp2": _p(0),
    "dp2-micro2-zero3": _p(3, microbatches=2),
}


@ranks_apart(NEEDS_DEGREES)
@pytest.mark.timeout(600)
def test_pipeline_and_data_parallel_parity():
    names = list(WORLD2)
    results = run_distributed(_matrix, 2, [WORLD2[n] for n in names], timeout=500)
    for i, name in enumerate(names):
        per_rank = [r[i] for r in results]
        pipe_parity.check(per_rank, clip=WORLD2[name].get("grad_clip_norm"))
        if WORLD2[name]["zero_stage"] >= 2:
            # gradients reduced once per batch, not once per micro-batch
            for r in per_rank:
                assert r["reductions"] == r["trainable_chunks"] * pipe_parity.STEPS, (name, r)
    coords = [r[0]["coords"] for r in results]
    assert coords == [(0, 0, 0), (0, 0, 1)]  # pipeline ranks, not data-parallel ones, in the pipeline configs
    assert pipe_parity.reference(clip=0.5)[2] > 0.5  # clipping was in effect


def _chimera(stage: int, pipeline: int, microbatches: int, **extra) -> dict:
    return {**_p(stage, pipeline=pipeline, schedule="chimera", microbatches=microbatches), **extra}


WORLD4_CHIMERA = {
    "pp4-chimera-zero1": _chimera(1, 4, 4),
    "pp4-chimera-zero3-clip": _chimera(3, 4, 4, grad_clip_norm=0.5),
    "pp2xdp2-chimera-zero1": _chimera(1, 2, 2),
    "pp2xdp2-chimera-zero3": _chimera(3, 2, 2, offload={"optimizer": "host"}),
    "tp2xpp2-chimera-sp-zero3": {
        **_chimera(3, 2, 2),
        "parallel": {"tensor": 2, "sequence": True, "pipeline": 2, "schedule": "chimera", "microbatches": 2},
    },
}


@ranks_apart(NEEDS_DEGREES)
@pytest.mark.timeout(600)
def test_chimera_parity_4_stages_and_2_stages_x_data_2():
    """Chimera at 4 stages on 4 processes and at 2 stages x data 2, ZeRO-1 and ZeRO-3 (and 2 stages x tensor 2 with
    sequence parallelism): the losses, gradient norm, weights and eval_batch of plain PyTorch (fp32, within fp32's
    own error of the float64 run: tests/tolerance.py); both replicas of every stage hold the same weights."""
    from hetero.models.gpt_pipe import TP_PLAN

    names = list(WORLD4_CHIMERA)
    configs = [WORLD4_CHIMERA[n] for n in names]
    configs[-1] = {**configs[-1], "parallel": {**configs[-1]["parallel"], "tensor_plan": TP_PLAN}}
    results = run_distributed(_matrix, 4, configs, timeout=540)
    for i, name in enumerate(names):
        per_rank = [r[i] for r in results]
        try:
            pipe_parity.check(per_rank, clip=configs[i].get("grad_clip_norm"))
        except AssertionError as err:
            raise AssertionError(f"{name}: {err}") from err
        p = configs[i]["parallel"]["pipeline"]
        states = {(r["coords"][0], r["coords"][2]): r["state"] for r in per_rank if r["state"] is not None}
        for (t, s), state in states.items():
            mirror = states[(t, p - 1 - s)]
            assert state.keys() == mirror.keys() and all(torch.equal(state[k], mirror[k]) for k in mirror), name
    assert [r[0]["coords"] for r in results] == [(0, 0, 0), (0, 0, 1), (0, 0, 2), (0, 0, 3)]
    assert [r[2]["coords"] for r in results] == [(0, 0, 0), (0, 1, 0), (0, 0, 1), (0, 1, 1)]


CK = {"activation_checkpointing": True}
CKPT = {
    # stages embed+layers.0 | layers.1+head: a block on each rank
    "gpipe-ckpt": {**_p(1, pipeline=2, schedule="gpipe", microbatches=2, pipeline_split=["layers.1"]), **CK},
    "1f1b-ckpt-offload": {
        **_p(0, pipeline=2, schedule="1f1b", microbatches=4, pipeline_split=["layers.1"]),
        **CK,
        "activation_offload": True,
    },
    "gpipe-ckpt-offload-zero3": {
        **_p(3, pipeline=2, schedule="gpipe", microbatches=2, pipeline_split=["layers.1"]),
        **CK,
        "activation_offload": True,
    },
    "interleaved-ckpt": {**_p(2, pipeline=2, schedule="interleaved_1f1b", microbatches=2), **CK},
    "interleaved-ckpt-offload": {
        **_p(1, pipeline=2, schedule="interleaved_1f1b", microbatches=4),
        **CK,
        "activation_offload": True,
    },
    "chimera-ckpt-offload-zero3": {
        **_p(3, pipeline=2, schedule="chimera", microbatches=4, pipeline_split=["layers.1"]),
        **CK,
        "activation_offload": True,
    },
}


@ranks_apart(NEEDS_DEGREES)
@pytest.mark.timeout(600)
def test_checkpointed_stages_match_for_every_schedule():
    """Activation checkpointing, without and with offload of the checkpointed blocks' inputs, inside pipeline stages,
    with all four schedules: the same losses and weights as without it (plain PyTorch); every rank's blocks ran their
    layers twice (forward, then recomputed in backward)."""
    names = list(CKPT)
    results = run_distributed(_ckpt_matrix, 2, [CKPT[n] for n in names], timeout=540)
    for i, name in enumerate(names):
        try:
            pipe_parity.check([r[i][0] for r in results])
        except AssertionError as err:
            raise AssertionError(f"{name}: {err}") from err
        for _, blocks, layers, offloaded in (r[i] for r in results):
            assert blocks > 0 and layers == 2 * blocks, (name, blocks, layers)
            assert (offloaded > 0) == bool(CKPT[name].get("activation_offload")), name


def _ckpt_matrix(rank: int, world: int, configs: list[dict]) -> list[tuple[dict, int, int, int]]:
    """pipe_parity.run, counting the checkpointed blocks' calls, their first layer's calls (recomputation runs the
    layers again, not the block) and the bytes offloaded."""
    from hetero import activation

    torch.set_num_threads(1)
    counts = {"blocks": 0, "layers": 0}
    original = activation.ActivationMemory.__init__

    def count(key: str) -> Any:
        def hook(*_: Any) -> None:
            counts[key] += torch.is_grad_enabled()  # eval_batch's forwards do not count

        return hook

    def init(self, *args, **kwargs):
        original(self, *args, **kwargs)
        for _, block in self.blocks:
            block.register_forward_pre_hook(count("blocks"))
            next(block.children()).register_forward_pre_hook(count("layers"))
        counts["memory"] = self

    out = []
    activation.ActivationMemory.__init__ = init
    try:
        for c in configs:
            counts.update(blocks=0, layers=0)
            result = pipe_parity.run(rank, world, c)
            out.append((result, counts["blocks"], counts["layers"], counts["memory"].offloaded_bytes))
    finally:
        activation.ActivationMemory.__init__ = original
    return out


FROZEN = ("embed.", "layers.0.")  # every parameter of the first of two stages


def _frozen_first_stage(dtype: torch.dtype) -> tuple[nn.Module, Any]:
    model = pipe_parity.build().to(dtype)
    for name, p in model.named_parameters():
        p.requires_grad_(not name.startswith(FROZEN))
    return model, parity.make_optimizer(model)


def _frozen_reference(dtype: torch.dtype) -> list[float]:
    model, opt = _frozen_first_stage(dtype)
    losses = []
    for x, y in parity.batches(3, 4):
        loss = model(x, labels=y).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _frozen_run(rank: int, world: int, stage: int) -> list[float]:
    torch.set_num_threads(1)
    model, opt = _frozen_first_stage(torch.float32)
    config = {"zero_stage": stage, "chunk_size": parity.CHUNK, "comm_timeout": 60}
    engine = hetero.initialize(model, opt, {**config, "parallel": {"pipeline": 2, "microbatches": 2}})
    losses = [float(engine.train_batch(x, y)) for x, y in parity.batches(3, 4)]
    engine.close()
    return losses


@ranks_apart(NEEDS_DEGREES)
@pytest.mark.timeout(300)
def test_a_frozen_first_stage_trains_like_plain_pytorch():
    """A fine-tuned model whose first pipeline stage is all frozen: that stage has no gradient to run backward with
    and no trainable chunk (it raised alone while the next stage waited for it), and the rest trains as plain
    PyTorch does, at ZeRO stages 0 and 3."""
    exact, plain = _frozen_reference(torch.float64), _frozen_reference(torch.float32)
    for stage in (0, 3):
        for losses in run_distributed(_frozen_run, 2, stage, timeout=240):
            tolerance.assert_losses(losses, exact, plain, dtype=torch.float32)


class _FailsOnRank(nn.Module):
    """A unit whose forward fails on one rank alone, as a unit too large for one GPU's free memory would."""

    def __init__(self, rank: int) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.rank = rank

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.rank == 1:
            raise RuntimeError("CUDA out of memory (a stand-in)")
        return self.lin(x)


def _time_units(rank: int, world: int) -> tuple[str, str]:
    import torch.distributed as dist

    from hetero.comm import Comm
    from hetero.device import Device

    model = nn.Sequential(nn.Linear(4, 4), _FailsOnRank(rank))
    try:
        balance.unit_costs(model, units_of(model), given=None, world=Comm(dist.group.WORLD), device=Device("cpu"))
        return ("ok", "")
    except Exception as e:  # noqa: BLE001 (the type is part of what is checked)
        return (type(e).__name__, str(e))


@ranks_apart(NEEDS_DEGREES)
@pytest.mark.timeout(120)
def test_timing_the_units_fails_on_every_rank_when_it_fails_on_one():
    """ "auto" balancing times the units on every rank, then averages over the world: a rank whose timing failed
    raises its own error and the others a PipelineError saying so, instead of waiting in the average."""
    ranks = run_distributed(_time_units, 2, timeout=90)
    assert ranks[1] == ("RuntimeError", "CUDA out of memory (a stand-in)")
    assert ranks[0][0] == "PipelineError" and "failed on another rank" in ranks[0][1], ranks[0]


def _tied_under_one_small_budget(rank: int, world: int) -> tuple[str, str]:
    from hetero.models.gpt import GPTConfig
    from hetero.models.gpt_pipe import GPTPipe

    torch.manual_seed(0)
    model = GPTPipe(GPTConfig(**{**pipe_parity.CFG, "tie_weights": True}))  # the embedding tied to the head
    memory = {"device_budget": 16 << 10, "host_budget": 4 << 20} if rank == 1 else {}
    config = {"zero_stage": 3, "chunk_size": "auto", "memory": memory, "comm_timeout": 30}
    try:
        engine = hetero.initialize(
            model, parity.make_optimizer(model), {**config, "parallel": {"pipeline": 2, "microbatches": 2}}
        )
        engine.close()
        return ("ok", "")
    except Exception as e:  # noqa: BLE001 (the type is part of what is checked)
        return (type(e).__name__, str(e))


@ranks_apart(NEEDS_DEGREES)
@pytest.mark.timeout(120)
def test_automatic_chunks_are_agreed_over_every_stage_holding_a_tied_weight():
    """The automatic chunk size follows the smallest budget; agreed over the data-parallel group alone, the last
    stage (a small budget) split the tied head into tiles and stopped while the first stage went on into its first
    transfer. Agreed over every rank, both stages decide alike: here both say the tied weight cannot be tiled."""
    ranks = run_distributed(_tied_under_one_small_budget, 2, timeout=90)
    assert ranks[0] == ranks[1] and ranks[0][0] == "ConfigError" and "tied across pipeline stages" in ranks[0][1]


class _ToBytes(nn.Module):
    """A first stage that hands the next one a tensor of a dtype no stage can send (uint8)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x).to(torch.uint8)


class _FromBytes(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x.float())


def _send_bytes(rank: int, world: int) -> tuple[str, str]:
    model = nn.Sequential(_ToBytes(), _FromBytes())
    config = {"zero_stage": 0, "comm_timeout": 30, "parallel": {"pipeline": 2, "microbatches": 2}}
    engine = hetero.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), config)
    try:
        engine.train_batch(torch.randn(4, 4), torch.randn(4, 4), loss_fn=nn.functional.mse_loss)
        return ("ok", "")
    except Exception as e:  # noqa: BLE001 (the type is part of what is checked)
        return (type(e).__name__, str(e))
    finally:
        engine.close()


@ranks_apart(NEEDS_DEGREES)
@pytest.mark.timeout(120)
def test_a_tensor_no_stage_can_send_stops_both_ends():
    """A stage whose output no header can describe (uint8 here) raises, and its header still goes, marked: the
    receiving stage raises too instead of waiting for it until the group's timeout."""
    sender, receiver = run_distributed(_send_bytes, 2, timeout=90)
    assert sender[0] == "PipelineError" and "cannot pass a torch.uint8 tensor" in sender[1], sender
    assert receiver[0] == "PipelineError" and "could not pass its tensor" in receiver[1], receiver


def _raise_on(stage: int, when: str):
    """What raises on its second call: a forward hook on the first stage, or the last stage's loss_fn."""
    calls = [0]

    def fail(*_: object) -> None:
        calls[0] += 1
        if calls[0] == 2:
            raise RuntimeError(f"user code failed on stage {stage} ({when})")

    return fail


def _one_stage_raises(rank: int, world: int, stage: int, schedule: str) -> dict:
    """Pipeline 2; pipeline rank `stage` raises in its second micro-batch. Then a batch that raises nowhere trains
    on every rank."""
    import time

    torch.set_num_threads(1)
    model = pipe_parity.build()
    m = 4
    config = {"zero_stage": 1, "comm_timeout": 60, "chunk_size": parity.CHUNK}
    config["parallel"] = {"pipeline": 2, "microbatches": m, "schedule": schedule, "pipeline_split": "params"}
    engine = hetero.initialize(model, parity.make_optimizer(model), config)
    (x, y), _ = parity.batches(2, 8)
    fail = _raise_on(stage, schedule)
    ce = nn.functional.cross_entropy
    if stage == 0:
        handle = engine.module.embed.register_forward_hook(fail) if engine.mesh.pp_rank == 0 else None
        loss_fn = None
    else:
        handle = None

        def loss_fn(out, labels):
            fail()
            return ce(out.flatten(0, 1), labels.flatten())

    start = time.monotonic()
    try:
        engine.train_batch(x, y, loss_fn=loss_fn)
        error = None
    except Exception as e:  # noqa: BLE001 (the type is part of what is checked)
        error = (type(e).__name__, str(e))
    seconds = time.monotonic() - start
    if handle is not None:
        handle.remove()
    after = float(engine.train_batch(x, y))
    engine.close()
    return {"error": error, "seconds": seconds, "after": after, "stage": engine.mesh.pp_rank}


@ranks_apart(NEEDS_DEGREES)
@pytest.mark.timeout(240)
@pytest.mark.parametrize("stage, schedule", [(0, "1f1b"), (1, "gpipe"), (1, "interleaved_1f1b")])
def test_a_stage_that_raises_mid_batch_stops_every_stage_at_once(stage, schedule):
    """The stage that raises gets its own error; the others a PipelineError naming it, at once. Before, they waited
    for its activations or gradients until comm_timeout (600 s by default), then named it dead or hung."""
    results = run_distributed(_one_stage_raises, 2, stage, schedule, timeout=200)
    for r in results:
        assert r["error"] is not None and r["seconds"] < 30, r
        kind, message = r["error"]
        if r["stage"] == stage:
            assert kind == "RuntimeError" and "user code failed" in message, r
        else:
            assert kind == "PipelineError" and f"pipeline rank {1 - r['stage']}" in message, r
            assert f"(global rank {1 - r['stage']}) raised during this batch" in message, r
    assert len({r["after"] for r in results}) == 1


def _after_a_failed_batch(rank: int, world: int, stage: int) -> dict:
    """Two batches trained after a batch whose loss_fn raised on its second micro-batch, and the same two batches in
    a run where that batch never happened."""
    torch.set_num_threads(1)
    losses = {}
    for fail in (False, True):
        model = pipe_parity.build()
        config = {"zero_stage": stage, "chunk_size": parity.CHUNK, "parallel": {"pipeline": 2, "microbatches": 2}}
        engine = hetero.initialize(model, parity.make_optimizer(model), config)
        (x, y), (x2, y2) = parity.batches(2, 4)
        calls = [0]

        def loss_fn(out, labels, calls=calls):
            calls[0] += 1
            if calls[0] == 2:
                raise RuntimeError("the loss failed")
            return nn.functional.cross_entropy(out.flatten(0, 1), labels.flatten())

        if fail:
            with pytest.raises(RuntimeError):  # its own on the last stage, a PipelineError naming it on the first
                engine.train_batch(x, y, loss_fn=loss_fn)
        losses[fail] = [float(engine.train_batch(x2, y2)) for _ in range(2)]
        engine.close()
    return losses


@ranks_apart(NEEDS_DEGREES)
@pytest.mark.timeout(240)
@pytest.mark.parametrize("stage", [1, 3])
def test_a_failed_batch_leaves_no_gradient_behind(stage):
    """The gradients a failed pipeline batch added before it raised are dropped, as engine.backward drops a failed
    backward's: the next update stepped on them (ZeRO-1: 3.9118 against 3.8796 for the second batch after), and at
    stages 2-3 the batch's summed gradient kept them even once dropped (its record of what it held was not reset)."""
    for losses in run_distributed(_after_a_failed_batch, 2, stage, timeout=200):
        assert losses[True] == losses[False], losses
