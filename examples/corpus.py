"""A tiny text corpus, a byte-level tokenizer and a deterministic batch stream for examples and tests.

The corpus ships with the repository (`examples/data/tiny_corpus.txt`, made by `examples/data/make_corpus.py`), so
examples and tests need no downloads. Tokens are the UTF-8 bytes of the text: a vocabulary of 256, no merges.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import torch

VOCAB_SIZE = 256
DEFAULT_CORPUS = Path(__file__).resolve().parent / "data" / "tiny_corpus.txt"


def load_corpus(path: str | None = None) -> str:
    """The text of `path`, by default the corpus shipped in the repository's examples/data."""
    p = Path(path) if path is not None else DEFAULT_CORPUS
    if not p.is_file():
        hint = " (it ships with the repository's examples/data)" if path is None else ""
        raise FileNotFoundError(f"corpus file {p} not found{hint}; pass a path to any UTF-8 text file")
    return p.read_text(encoding="utf-8")


def encode(text: str) -> torch.Tensor:
    """Token ids of `text`: its UTF-8 bytes, as a 1-D uint8 tensor."""
    return torch.frombuffer(bytearray(text.encode("utf-8")), dtype=torch.uint8)


def decode(ids: torch.Tensor | list[int]) -> str:
    """Text of byte token ids; a multi-byte character cut in half becomes U+FFFD instead of an error."""
    if isinstance(ids, torch.Tensor):
        ids = ids.flatten().tolist()
    return bytes(ids).decode("utf-8", errors="replace")


def batches(
    text: str,
    *,
    block_size: int,
    batch_size: int,
    seed: int,
    rank: int = 0,
    world_size: int = 1,
    hf_labels: bool = False,
) -> Iterator[dict[str, torch.Tensor]]:
    """An endless stream of `{"input_ids", "labels"}` LongTensor[batch_size, block_size] on the CPU.

    Each step draws a *global* batch of `batch_size * world_size` random windows of the text from a generator seeded
    with `seed`; rank r takes rows r*batch_size .. (r+1)*batch_size. So the stream depends only on the seed and the
    global batch size: the ranks' slices partition one global batch, and world_size=2 with batch_size=4 sees exactly
    the rows of world_size=1 with batch_size=8. The global random state is not touched.

    labels[:, t] is the byte after input_ids[:, t] (aligned targets, as `hetero.models.GPT` expects). With
    `hf_labels=True`, labels is a copy of input_ids instead, for Hugging Face models, which shift labels themselves.
    """
    for name, value in (("block_size", block_size), ("batch_size", batch_size), ("world_size", world_size)):
        if value < 1:
            raise ValueError(f"{name} = {value} must be >= 1")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank = {rank} must lie in [0, world_size = {world_size})")
    data = encode(text)
    # A window needs block_size + 1 bytes: the inputs and, one further, the last label.
    n_starts = data.numel() - block_size
    if n_starts < 1:
        raise ValueError(f"text of {data.numel()} bytes is too short for block_size {block_size}")
    gen = torch.Generator().manual_seed(seed)
    offsets = torch.arange(block_size + 1)
    rows = slice(rank * batch_size, (rank + 1) * batch_size)
    while True:
        # Draw the whole global batch on every rank, so each rank's generator stays in step with the others.
        starts = torch.randint(0, n_starts, (batch_size * world_size,), generator=gen)
        windows = data[starts[rows, None] + offsets].long()
        input_ids = windows[:, :-1]
        labels = input_ids.clone() if hf_labels else windows[:, 1:]
        yield {"input_ids": input_ids.contiguous(), "labels": labels.contiguous()}
