"""Gradient hooks on a model built on the meta device survive its parameters' swap into real memory ([Note: hooks
across swap_tensors] in hetero/zero/meta_swap.py). The forty-fourth session's fuzzer found Qwen3 on the meta device
with `weights=` at tensor 2 training its q/k norms on one rank's part of their gradient: tensor parallelism's
`head_norm` hook, registered before the swap, never ran after it. Against plain PyTorch: float64 as the exact run and
plain fp32's distance from it as the scale (tests/tolerance.py)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import hetero
from tests import tolerance
from tests.dist import NEEDS_DEGREES, ranks_apart, run_distributed
from tests.plain_loop import train_plain

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

F32, F64 = torch.float32, torch.float64


def _tripled(grad: torch.Tensor) -> torch.Tensor:
    return grad * 3


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1))


def test_a_users_hook_on_a_meta_parameter_runs(tmp_path):
    """A hook registered on the meta model before initialize scales its gradient as on a normally built model."""
    path = str(tmp_path / "mlp.safetensors")
    safetensors_torch.save_model(_mlp(), path)
    x, y = torch.randn(4, 8, generator=torch.Generator().manual_seed(1)), torch.zeros(4, 1)

    plain = _mlp()
    plain[0].weight.register_hook(_tripled)
    nn.functional.mse_loss(plain(x), y).backward()
    torch.optim.SGD(plain.parameters(), lr=0.1).step()

    with torch.device("meta"):
        model = _mlp()
    model[0].weight.register_hook(_tripled)
    engine = hetero.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), {"chunk_size": 256}, weights=path)
    engine.backward(nn.functional.mse_loss(engine(x), y))
    engine.step()
    got = engine.full_state_dict()
    engine.close()
    for name, want in plain.state_dict().items():
        assert torch.allclose(got[name], want, rtol=1e-6, atol=1e-7), name  # a lost hook: a third of the step


VOCAB, ROWS, SEQ, STEPS = 64, 4, 8, 2


def _qwen3() -> nn.Module:
    torch.manual_seed(0)
    return transformers.Qwen3ForCausalLM(
        transformers.Qwen3Config(
            vocab_size=VOCAB,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=8,
            max_position_embeddings=16,
            tie_word_embeddings=False,
        )  # fmt: skip
    )


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randint(0, VOCAB, (ROWS, SEQ), generator=g),) * 2 for _ in range(STEPS)]


def _meta_qwen3(rank: int, world: int, path: str) -> dict:
    torch.set_num_threads(1)
    with torch.device("meta"):
        model = _qwen3()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    engine = hetero.initialize(model, opt, {"parallel": {"tensor": 2}}, weights=path)
    losses = [float(engine.train_batch(x, y)) for x, y in _batches()]
    full = engine.full_state_dict()
    engine.close()
    return {"losses": losses, "full": full if rank == 0 else None}


@ranks_apart(NEEDS_DEGREES)
@pytest.mark.timeout(180)
def test_qwen3_on_meta_at_tensor_2_sums_its_head_norms_gradients(tmp_path):
    """The q/k norms' gradients are summed over the tensor ranks: losses and every weight as plain PyTorch's."""
    path = str(tmp_path / "qwen3.safetensors")
    safetensors_torch.save_model(_qwen3(), path)
    reference = {}
    for dtype in (F64, F32):
        model = _qwen3().to(dtype)
        reference[dtype] = train_plain(model, torch.optim.SGD(model.parameters(), lr=0.5), _batches())
    results = run_distributed(_meta_qwen3, 2, path, timeout=150)
    (exact_losses, exact, _), (plain_losses, plain, _) = reference[F64], reference[F32]
    for r in results:
        tolerance.assert_losses(r["losses"], exact_losses, plain_losses, dtype=F32)
    tolerance.assert_weights(results[0]["full"], exact, plain, dtype=F32)
