"""[Note: generating in step]: Hugging Face's `generate` on a model at stage 3 over two ranks, each rank given other
prompts that end at other lengths, runs without `synced_gpus` being passed, and each rank's tokens are those the plain
model generates from its prompts; `synced_gpus=False` is still obeyed; closing the engine takes the default away.

Greedy decoding picks the largest logit: the same fp32 forward on the same weights (stage 3 gathers them whole, bit
for bit) gives the same tokens as the plain model, so the outputs are compared exactly.

Under a 2D grid (batch and hidden cut two ways) generate gives the plain model's greedy tokens too, from unpadded and
left-padded prompts: the prompts' mask and positions are cut with the batch ([Note: row inputs under a grid]) and
the head's logits gathered whole inside generate (`LogitsHead`). Its sums run in other orders than the plain
model's: the tiny model's top two logits are far enough apart that they pick the same tokens."""

from __future__ import annotations

import copy

import pytest
import torch

import hetero
from tests import test_unmodified_models as unmodified
from tests.dist import NEEDS_DEGREES, ONLY_SEVERAL, RANKS_DIFFER, ranks_apart, run_distributed

pytest.importorskip("transformers")


def _greedy(model: torch.nn.Module, prompts: torch.Tensor, new: int, **kwargs) -> torch.Tensor:
    with torch.no_grad():
        mask = torch.ones_like(prompts)
        return model.generate(prompts, attention_mask=mask, max_new_tokens=new, **{"do_sample": False, **kwargs})


def _job(rank: int, world: int, peft: bool) -> dict:
    model = unmodified.tiny_hf()
    model.generation_config.pad_token_id = 0
    prompts = torch.randint(1, 96, (2, 5), generator=torch.Generator().manual_seed(10 + rank))
    new = 3 + 5 * rank  # rank 0 ends after 3 tokens, rank 1 after 8: rank 0 runs forwards on for rank 1
    if peft:
        import peft as peft_lib

        model = peft_lib.get_peft_model(
            model, peft_lib.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
        )
    plain = _greedy(copy.deepcopy(model).eval(), prompts, new)
    engine = hetero.initialize(model, None, {"zero_stage": 3, "chunk_size": 1024, "comm_timeout": 60})
    model.eval()
    out = {"same": torch.equal(_greedy(model, prompts, new), plain), "tokens": plain.shape[1] - prompts.shape[1]}
    out["given"] = sorted(m.__class__.__name__ for m in model.modules() if "generate" in m.__dict__)
    # Given explicitly, synced_gpus decides: both ranks generate equally long here, so no rank waits for another.
    out["unsynced_same"] = torch.equal(_greedy(model, prompts, 4, synced_gpus=False), _greedy(model, prompts, 4))
    engine.close()
    out["left"] = [m.__class__.__name__ for m in model.modules() if "generate" in m.__dict__]
    return out


@ranks_apart(RANKS_DIFFER)
@pytest.mark.timeout(200)
def test_generate_at_stage_3_over_two_ranks_ending_at_other_lengths():
    for rank, r in enumerate(run_distributed(_job, 2, False, timeout=170)):
        assert r["same"] and r["unsynced_same"], (rank, r)
        assert r["tokens"] == 3 + 5 * rank, r  # no EOS in the way: the ranks did end at other lengths
        assert r["given"] == ["LlamaForCausalLM"] and r["left"] == [], r


@ranks_apart(ONLY_SEVERAL)
@pytest.mark.timeout(200)
def test_generate_of_a_peft_model_reaches_the_model_inside():
    """A PEFT wrapper's `generate` takes no `synced_gpus` of its own: it calls the wrapped model's, which has it."""
    pytest.importorskip("peft")
    for r in run_distributed(_job, 2, True, timeout=170):
        assert r["same"] and r["unsynced_same"], r
        assert r["given"] == ["LlamaForCausalLM"] and r["left"] == [], r


def _grid_job(rank: int, world: int) -> dict:
    """Greedy generate on a 2D grid (q = 2: batch and hidden cut two ways) through the engine at stage 3, for Llama
    and GPT-2, from unpadded and left-padded prompts; and a plain forward, whose logits stay cut."""
    from tests import grid_parity

    torch.set_num_threads(1)
    out: dict = {}
    for family in ("llama", "gpt2"):
        for padded in (False, True):
            prompts = torch.randint(1, grid_parity.VOCAB, (4, 6), generator=torch.Generator().manual_seed(0))
            mask = torch.ones_like(prompts)
            if padded:  # rows 1 and 3 left-padded (as a tokenizer pads for generation): other positions, a mask
                mask[1, :2] = mask[3, :3] = 0
                prompts = prompts.masked_fill(mask == 0, 0)
            kwargs = dict(attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=0)
            with torch.no_grad():
                want = grid_parity.build(family).eval().generate(prompts, **kwargs)
            model = grid_parity.build(family)
            config = {"zero_stage": 3, "chunk_size": 4096, "parallel": {"tensor": 4, "tensor_mode": "2d"}}
            engine = hetero.initialize(model, None, config)
            model.eval()
            with torch.no_grad(), engine.device.compute_context():
                got = model.generate(engine.to_device(prompts), **{**kwargs, "attention_mask": engine.to_device(mask)})
                cut = tuple(engine(prompts).logits.shape)
            out[(family, padded)] = {"same": torch.equal(got.cpu(), want), "got": got.tolist(), "cut": cut}
            out[(family, padded)]["want"] = want.tolist()
            engine.close()
    return out


@ranks_apart(NEEDS_DEGREES)
@pytest.mark.timeout(200)
def test_generate_on_a_2d_grid_model_gives_the_plain_models_tokens():
    """generate used to fail inside the model (the rotary tables and masks built for the whole batch met activations
    of half its rows), and a padded mask would be read from the first rows on every rank: now the mask and positions
    are cut with the batch and the head's logits gathered whole (rows and vocabulary) inside generate."""
    for r in run_distributed(_grid_job, 4, timeout=170):
        for key, res in r.items():
            assert res["same"], (key, res["got"], res["want"])
            assert res["cut"] == (2, 6, 32), (key, res["cut"])  # outside generate: this rank's rows and vocabulary


def _refused_job(rank: int, world: int, parallel: dict) -> dict:
    """generate under a pipeline or a sequence split is refused by name on every rank; what the error advises
    (hetero.models.generate_greedy through the engine) gives the plain model's greedy tokens."""
    from hetero.models import generate_greedy

    torch.set_num_threads(1)
    model = unmodified.tiny_hf()
    model.generation_config.pad_token_id = 0
    prompts = torch.randint(1, 96, (2, 5), generator=torch.Generator().manual_seed(10))
    want = _greedy(copy.deepcopy(model).eval(), prompts, 3)
    engine = hetero.initialize(model, None, {"zero_stage": 1, "parallel": parallel, "comm_timeout": 60})
    model.eval()
    out: dict = {}
    try:
        _greedy(model, prompts, 3)
    except hetero.errors.HeteroError as e:
        out["error"] = str(e)
    out["same"] = torch.equal(generate_greedy(engine, prompts, max_new_tokens=3, block_size=8), want)
    engine.close()
    out["left"] = [m.__class__.__name__ for m in model.modules() if "generate" in m.__dict__]
    return out


@ranks_apart(NEEDS_DEGREES)
@pytest.mark.timeout(200)
@pytest.mark.parametrize(
    "parallel, said",
    [({"pipeline": 2}, "parallel.pipeline > 1"), ({"tensor": 2, "sequence": True}, "cuts every sequence into 2")],
)
def test_generate_under_a_pipeline_or_sequence_split_is_refused_by_name(parallel, said):
    """It failed inside the model: under a pipeline at the first layer this rank does not hold ("'NoneType' object is
    not callable"), under a sequence split at the first decode step's one token, advising to pad the sequence."""
    for r in run_distributed(_refused_job, 2, parallel, timeout=170):
        assert said in r.get("error", "") and "generate_greedy" in r["error"], r
        assert r["same"] and r["left"] == [], r


def _tensor_job(rank: int, world: int) -> dict:
    """generate under 1D tensor parallelism (two ranks, one model): one prompt and one random stream per group."""
    torch.set_num_threads(1)
    model = unmodified.tiny_hf()
    model.generation_config.pad_token_id = 0
    prompts = torch.randint(1, 96, (2, 5), generator=torch.Generator().manual_seed(10))
    engine = hetero.initialize(model, None, {"zero_stage": 1, "parallel": {"tensor": 2}, "comm_timeout": 60})
    model.eval()
    out: dict = {}
    torch.manual_seed(7)
    out["sampled"] = _greedy(model, prompts, 4, do_sample=True).tolist()  # seeded alike: the same tokens
    for case, seed, own in (("seeds", 7 + rank, prompts), ("prompts", 7, prompts + rank)):
        torch.manual_seed(seed)
        try:
            _greedy(model, own, 4, do_sample=case == "seeds")
        except hetero.errors.BatchMismatchError as e:
            out[case] = str(e)
    torch.manual_seed(7 + rank)  # greedy draws nothing: seeds apart do not matter
    out["greedy"] = _greedy(model, prompts, 4).tolist()
    engine.close()
    out["left"] = [m.__class__.__name__ for m in model.modules() if "generate" in m.__dict__]
    return out


@ranks_apart(NEEDS_DEGREES)
@pytest.mark.timeout(200)
def test_generate_under_tensor_parallelism_agrees_on_prompts_and_streams(cpu_device):  # model.generate: CPU ranks
    """[Note: one prompt and one stream per tensor group]: ranks seeded apart sampled other tokens, and ranks given
    other prompts generated from a mix of both, each with no error."""
    r0, r1 = run_distributed(_tensor_job, 2, timeout=170)
    assert r0["sampled"] == r1["sampled"] and r0["greedy"] == r1["greedy"], (r0, r1)
    for r in (r0, r1):
        assert "random streams (sampling: seed these ranks alike)" in r.get("seeds", ""), r
        assert "same shapes but different values" in r.get("prompts", ""), r
        assert r["left"] == [], r


def _gpt_job(rank: int, world: int) -> dict:
    """hetero's own `generate_greedy` through an engine under 1D tensor parallelism."""
    from hetero.models import GPT, GPTConfig, generate_greedy

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, n_layer=2, n_head=2, n_embd=32, block_size=16))
    prompts = torch.randint(0, 64, (2, 4), generator=torch.Generator().manual_seed(1))
    want = generate_greedy(copy.deepcopy(model).eval(), prompts, max_new_tokens=5, block_size=16)
    engine = hetero.initialize(model, None, {"zero_stage": 3, "chunk_size": 4096, "parallel": {"tensor": 2}})
    engine.eval()
    got = generate_greedy(engine, prompts, max_new_tokens=5, block_size=16)
    engine.close()
    return {"same": torch.equal(got.cpu(), want), "got": got.tolist(), "want": want.tolist()}


@ranks_apart(NEEDS_DEGREES)
@pytest.mark.timeout(200)
def test_generate_greedy_through_a_tensor_parallel_engine_gives_the_plain_models_tokens():
    """`engine(...)` leaves the logits cut by vocabulary: each rank picked the largest of its half by its index there,
    the ranks' next batches differed, and the batch agreement stopped them at the second token. generate_greedy now
    reads an engine's whole logits (eval_batch). Its sums run in other orders than the plain model's: the tiny model's
    top two logits are far enough apart that they pick the same tokens, as in the grid test above."""
    for r in run_distributed(_gpt_job, 2, timeout=170):
        assert r["same"], r
