"""The GPT of `gpt.py` laid out for pipelining: a model whose forward runs its children in order.

Children: `embed` (token + position embeddings), `layers` (the blocks, a ModuleList) and `head` (final LayerNorm,
output projection and, given labels, the loss). The pipeline splitter (hetero/parallel/pipeline/split.py) cuts it at
any of `embed`, `layers.i`, `head`. Built from a `GPT`, it shares that model's modules, so the same seed gives the same
weights. With tie_weights the embedding and the head share one parameter, which the pipeline keeps on both stages
(hetero/parallel/pipeline/tied.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hetero.models.gpt import GPT, INIT_STD, GPTConfig, GPTOutput

# Tensor-parallel plan (hetero.parallel.plans styles) for GPTPipe: GPT's built-in plan under its new names.
TP_PLAN = {
    "embed.tok": "vocab",
    "embed.pos": "embedding",
    "embed.drop": "sequence_scatter",
    "layers.*.ln_?": "norm",
    "layers.*.attn": "heads",
    "layers.*.attn.?_proj": "colwise",
    "layers.*.attn.o_proj": "rowwise",
    "layers.*.mlp": "parallel_input",
    "layers.*.mlp.fc": "colwise",
    "layers.*.mlp.proj": "rowwise",
    "head.ln_f": "norm+sequence_gather",
    "head.lm_head": "vocab_head",
}


class Embeddings(nn.Module):
    def __init__(self, tok: nn.Embedding, pos: nn.Embedding, drop: nn.Dropout, block_size: int) -> None:
        super().__init__()
        self.tok, self.pos, self.drop, self.block_size = tok, pos, drop, block_size

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        t = input_ids.shape[1]
        if t > self.block_size:
            raise ValueError(f"sequence length {t} exceeds block_size {self.block_size}")
        return self.drop(self.tok(input_ids) + self.pos(torch.arange(t, device=input_ids.device)))


class Head(nn.Module):
    def __init__(self, ln_f: nn.LayerNorm, lm_head: nn.Linear) -> None:
        super().__init__()
        self.ln_f, self.lm_head = ln_f, lm_head

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> GPTOutput | torch.Tensor:
        """The logits; with labels (aligned, as in GPT.forward), a GPTOutput with the mean cross entropy too."""
        logits = self.lm_head(self.ln_f(x))
        if labels is None:
            return logits
        return GPTOutput(logits=logits, loss=self.loss_function(logits, labels))

    def loss_function(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Mean cross entropy of aligned labels, -100 ignored (fp32, as GPT's). Tensor parallelism replaces it, per
        instance, by the vocabulary-parallel loss on sharded logits."""
        return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=-100)


class GPTPipe(nn.Module):
    def __init__(self, config: GPTConfig | None = None, *, gpt: GPT | None = None) -> None:
        super().__init__()
        if (config is None) == (gpt is None):
            raise ValueError("GPTPipe takes a GPTConfig or an existing GPT (gpt=...), exactly one")
        gpt = gpt if gpt is not None else GPT(config)
        self.config = gpt.config
        self.embed = Embeddings(gpt.embed, gpt.pos_embed, gpt.drop, gpt.config.block_size)
        self.layers = gpt.layers
        self.head = Head(gpt.ln_f, gpt.lm_head)

    def reset_parameters(self) -> None:
        """GPT.reset_parameters under this layout's names, in its order: built on the meta device (hetero.lazy_init()),
        GPTPipe gets the values GPTPipe(config) gets from the same seed (without it, the replay ran each module's own
        reset_parameters: N(0, 1) embeddings, torch's Linear init for the head). The tie, made when GPT was built, is
        kept as it is (a pipeline may hold the two ends on different stages, tied.py)."""
        nn.init.normal_(self.embed.tok.weight, mean=0.0, std=INIT_STD)
        nn.init.normal_(self.embed.pos.weight, mean=0.0, std=INIT_STD)
        for block in self.layers:
            block.reset_parameters()
        self.head.ln_f.reset_parameters()
        if not self.config.tie_weights:
            nn.init.normal_(self.head.lm_head.weight, mean=0.0, std=INIT_STD)
            if self.head.lm_head.bias is not None:
                nn.init.zeros_(self.head.lm_head.bias)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> GPTOutput:
        x = self.embed(input_ids)
        for block in self.layers:
            x = block(x)
        out = self.head(x, labels)
        return out if isinstance(out, GPTOutput) else GPTOutput(logits=out)
