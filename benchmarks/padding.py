"""Chunk padding of the automatic chunk size for Hugging Face model shapes, from 125M to 70B parameters.

    python benchmarks/padding.py [--world-size 8] [--device-budget 80GiB --host-budget 1TiB] [--json]

Every model is built on the meta device from its configuration (no download, no memory) and laid out with the
engine's own `build_layout`, through `hetero.estimate` (the estimator and the engine share the layout, so their
padding is the same by construction; tests/test_tiling.py checks the engine's ledgers against the estimate).
Padding = the chunks' total capacity over the parameters, minus one: every tier pays it. Target: at most 10% on
every row. Weights larger than a chunk are split into tiles ([Note: tiles]); the table counts them.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402

from hetero.config import parse_size  # noqa: E402

TARGET = 0.10


def _llama(h: int, layers: int, inter: int, heads: int, kv: int, vocab: int = 32000, **kw: object) -> tuple:
    return "LlamaConfig", dict(
        hidden_size=h,
        num_hidden_layers=layers,
        intermediate_size=inter,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        vocab_size=vocab,
        **kw,
    )


# (family, size, transformers config class, its arguments): the published shapes of each size.
MODELS: list[tuple[str, str, str, dict]] = [
    ("llama", "125M", *_llama(768, 12, 2048, 12, 12)),
    ("llama", "1.1B", *_llama(2048, 22, 5632, 32, 4)),
    ("llama", "7B", *_llama(4096, 32, 11008, 32, 32)),
    ("llama", "13B", *_llama(5120, 40, 13824, 40, 40)),
    ("llama", "70B", *_llama(8192, 80, 28672, 64, 8)),
    ("mistral", "7B", "MistralConfig", dict(hidden_size=4096, num_hidden_layers=32, intermediate_size=14336,
                                            num_attention_heads=32, num_key_value_heads=8, vocab_size=32000)),
    ("gpt2", "124M", "GPT2Config", dict(n_embd=768, n_layer=12, n_head=12)),
    ("gpt2", "355M", "GPT2Config", dict(n_embd=1024, n_layer=24, n_head=16)),
    ("gpt2", "774M", "GPT2Config", dict(n_embd=1280, n_layer=36, n_head=20)),
    ("gpt2", "1.5B", "GPT2Config", dict(n_embd=1600, n_layer=48, n_head=25)),
    ("gpt2", "6.6B", "GPT2Config", dict(n_embd=4096, n_layer=32, n_head=32)),
    ("opt", "125M", "OPTConfig", dict(hidden_size=768, num_hidden_layers=12, ffn_dim=3072, num_attention_heads=12)),
    ("opt", "1.3B", "OPTConfig", dict(hidden_size=2048, num_hidden_layers=24, ffn_dim=8192, num_attention_heads=32)),
    ("opt", "6.7B", "OPTConfig", dict(hidden_size=4096, num_hidden_layers=32, ffn_dim=16384, num_attention_heads=32)),
    ("opt", "13B", "OPTConfig", dict(hidden_size=5120, num_hidden_layers=40, ffn_dim=20480, num_attention_heads=40)),
    ("opt", "30B", "OPTConfig", dict(hidden_size=7168, num_hidden_layers=48, ffn_dim=28672, num_attention_heads=56)),
    ("opt", "66B", "OPTConfig", dict(hidden_size=9216, num_hidden_layers=64, ffn_dim=36864, num_attention_heads=72)),
    ("gpt_neox", "160M", "GPTNeoXConfig", dict(hidden_size=768, num_hidden_layers=12, intermediate_size=3072,
                                               num_attention_heads=12, vocab_size=50304)),
    ("gpt_neox", "1.4B", "GPTNeoXConfig", dict(hidden_size=2048, num_hidden_layers=24, intermediate_size=8192,
                                               num_attention_heads=16, vocab_size=50304)),
    ("gpt_neox", "6.9B", "GPTNeoXConfig", dict(hidden_size=4096, num_hidden_layers=32, intermediate_size=16384,
                                               num_attention_heads=32, vocab_size=50432)),
    ("gpt_neox", "20B", "GPTNeoXConfig", dict(hidden_size=6144, num_hidden_layers=44, intermediate_size=24576,
                                              num_attention_heads=64, vocab_size=50432)),
    ("qwen2", "0.5B", "Qwen2Config", dict(hidden_size=896, num_hidden_layers=24, intermediate_size=4864,
                                          num_attention_heads=14, num_key_value_heads=2, vocab_size=151936,
                                          tie_word_embeddings=True)),
    ("qwen2", "1.5B", "Qwen2Config", dict(hidden_size=1536, num_hidden_layers=28, intermediate_size=8960,
                                          num_attention_heads=12, num_key_value_heads=2, vocab_size=151936,
                                          tie_word_embeddings=True)),
    ("qwen2", "7B", "Qwen2Config", dict(hidden_size=3584, num_hidden_layers=28, intermediate_size=18944,
                                        num_attention_heads=28, num_key_value_heads=4, vocab_size=152064)),
    ("qwen2", "72B", "Qwen2Config", dict(hidden_size=8192, num_hidden_layers=80, intermediate_size=29568,
                                         num_attention_heads=64, num_key_value_heads=8, vocab_size=152064)),
    ("gemma", "2B", "GemmaConfig", dict(hidden_size=2048, num_hidden_layers=18, intermediate_size=16384,
                                        num_attention_heads=8, num_key_value_heads=1, head_dim=256,
                                        vocab_size=256000)),
    ("gemma", "7B", "GemmaConfig", dict(hidden_size=3072, num_hidden_layers=28, intermediate_size=24576,
                                        num_attention_heads=16, num_key_value_heads=16, head_dim=256,
                                        vocab_size=256000)),
]  # fmt: skip


def meta_model(cls_name: str, kwargs: dict) -> torch.nn.Module:
    import transformers

    config = getattr(transformers, cls_name)(**kwargs)
    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(config)


def row(family: str, size: str, cls_name: str, kwargs: dict, args: argparse.Namespace) -> dict:
    from hetero.profiler import estimate

    model = meta_model(cls_name, kwargs)
    config = {"zero_stage": 3, "memory": {"device_budget": args.device_budget, "host_budget": args.host_budget}}
    t0 = time.perf_counter()
    est = estimate(model, config, world_size=args.world_size, machine=False, inputs={})
    layout_s = time.perf_counter() - t0
    tiles = sum(1 for _ in _tiled(model, est))
    return {
        "family": family,
        "size": size,
        "n_params": est.n_params,
        "chunk_elements": est.chunk_elements,
        "n_chunks": est.n_chunks,
        "chunk_numel": getattr(est, "chunk_numel", 0),  # 0: an estimator without it (main before issue 14)
        "tiled_weights": tiles,
        "padding": est.chunk_elements / est.n_params - 1,
        "estimate_s": layout_s,
    }


def _tiled(model: torch.nn.Module, est: object) -> list[str]:
    return list(getattr(est, "tiled", ()))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world-size", type=int, default=1, help="data-parallel ranks (capacities divide by it)")
    p.add_argument("--device-budget", default=None, help="per-rank device budget (default: none, no cap)")
    p.add_argument("--host-budget", default=None, help="per-rank host budget (default: none, no cap)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    for key in ("device_budget", "host_budget"):
        value = getattr(args, key)
        if value is not None:
            setattr(args, key, parse_size(value, key=f"--{key.replace('_', '-')}"))
    try:
        from tqdm import tqdm
    except ImportError:  # the progress bar is optional

        def tqdm(x, **_):
            return x

    rows = [row(*m, args) for m in tqdm(MODELS, desc="models", file=sys.stderr)]
    worst = max(r["padding"] for r in rows)
    if args.json:
        print(json.dumps({"rows": rows, "worst_padding": worst, "target": TARGET, "world_size": args.world_size}))
        return 0
    print(f"{'family':<10}{'size':>6}{'parameters':>16}{'chunk elements':>16}{'chunks':>8}{'chunk':>12}"
          f"{'tiled':>7}{'padding':>9}")  # fmt: skip
    for r in rows:
        print(
            f"{r['family']:<10}{r['size']:>6}{r['n_params']:>16,}{r['chunk_elements']:>16,}{r['n_chunks']:>8}"
            f"{r['chunk_numel']:>12,}{r['tiled_weights']:>7}{100 * r['padding']:>8.2f}%"
        )
    verdict = "met" if worst <= TARGET else "NOT met"
    print(f"worst padding {100 * worst:.2f}% (target <= {100 * TARGET:.0f}%: {verdict}); world size {args.world_size}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
