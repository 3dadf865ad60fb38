"""examples/train_trainer.py's data: a run that asks for more text than the shipped corpus holds trains over the
windows it has for several epochs, each window a full block, instead of failing in the Trainer's collator on the
short and empty windows cut past the corpus' end."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers", minversion="5.0")
pytest.importorskip("accelerate")

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "examples"))  # the example imports its neighbours (corpus.py) as a script does

import train_trainer  # noqa: E402
from corpus import encode, load_corpus  # noqa: E402


def test_more_steps_than_the_corpus_holds(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    block = 64
    held = len(encode(load_corpus())) // block  # ~4700 windows of 64 bytes in the shipped corpus
    args = argparse.Namespace(steps=held, batch_size=4, grad_accum=2, block_size=block)  # 8x what it holds
    train_set, eval_set = train_trainer.datasets(args)
    assert len(train_set) + len(eval_set) == held
    for rows in (train_set, eval_set):
        assert all(len(rows[i]["input_ids"]) == block for i in range(len(rows)))
    # A run that fits takes a window per sample, as before.
    args.steps = 3
    assert len(train_trainer.datasets(args)[0]) == 3 * 4 * 2


def test_a_block_larger_than_the_corpus_is_a_usage_error(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["train_trainer.py", "--block-size", str(len(encode(load_corpus())))])
    with pytest.raises(SystemExit) as e:
        train_trainer.main()
    assert e.value.code == 2 and "give a smaller --block-size" in capsys.readouterr().err
