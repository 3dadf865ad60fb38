"""Tiny Hugging Face Phi-3 models for the parity tests (`grid_parity.build` hands it the families named "phi3*").

Phi-3 fuses q/k/v into `qkv_proj` (styled 'colwise_qkv') and gate/up into `gate_up_proj` ('colwise_gate_up'); its
rotary embedding has variants the other families' do not (LongRoPE's short and long factors, a partial rotary
dimension), and some of its configs a sliding window. Each family here is one released layout, shrunk:
 - "phi3": Phi-3-medium and Phi-4: fewer key/value heads than query heads, so qkv_proj's blocks differ in width
   (64 + 32 + 32);
 - "phi3-mha": Phi-3-mini-4k: as many key/value heads as query heads (equal blocks) and a sliding window (4 of the
   tests' 8 positions, so it masks);
 - "phi3-long": Phi-4-mini: LongRoPE ("longrope", short and long factors) over 3/4 of each head's dimensions
   (`partial_rotary_factor` 0.75); its original context (4) is shorter than the tests' sequences (8), so the long
   factors and LongRoPE's attention scale are in use; its embedding is tied to the head (under a pipeline: held by
   the first and last stages, whole in one chunk each: `TIED_CHUNK`).
"""

from __future__ import annotations

import copy

import torch

VOCAB = 128
HEADS, HEAD_DIM = 4, 16
TIED_CHUNK = 8192  # elements: the tied embedding whole (128 x 64), as a pipeline needs it ([Note: parameters tied
# across stages] in hetero/parallel/pipeline/tied.py)
LONG_DIMS = 6  # LongRoPE's factors: one per rotated pair, (16 x 0.75) / 2
FAMILIES = {
    "phi3": {"num_key_value_heads": 2},
    "phi3-mha": {"num_key_value_heads": 4, "sliding_window": 4},
    "phi3-long": {
        "num_key_value_heads": 2,
        "tie_word_embeddings": True,
        "partial_rotary_factor": 0.75,
        "original_max_position_embeddings": 4,
        "rope_scaling": {
            "rope_type": "longrope",
            "short_factor": [1.0 + 0.25 * i for i in range(LONG_DIMS)],
            "long_factor": [2.0 + 1.5 * i for i in range(LONG_DIMS)],
        },
    },
}


def build(family: str) -> torch.nn.Module:
    """The family's Phi-3 (hidden 64, 4 query heads of 16, an MLP of 128, 4 layers, eager attention), initialised
    from the caller's seed."""
    import transformers

    cfg = transformers.Phi3Config(
        vocab_size=VOCAB, hidden_size=HEADS * HEAD_DIM, intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=HEADS, max_position_embeddings=16, pad_token_id=0, bos_token_id=0, eos_token_id=0,
        attn_implementation="eager", **copy.deepcopy(FAMILIES[family]),  # the config keeps rope_scaling's dict
    )  # fmt: skip
    return transformers.Phi3ForCausalLM(cfg)
