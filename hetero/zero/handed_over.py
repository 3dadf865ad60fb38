"""The optimizer a user hands to `hetero.initialize`, kept from doing silently nothing afterwards.

[Note: the optimizer handed over]
Once the engine holds a model, the optimizer object the user built still has its param groups (shared with
`engine.optimizer`, so a loop's own `group["lr"] = ...` and a scheduler built on it still drive the update), but its
parameters never get a `.grad` (gradients go into chunks) and its `state` stays empty (states live in chunks across
tiers and ranks). So a loop ported from plain PyTorch that calls `optimizer.step()` updated nothing, without a word
(measured: the loss of every step equal to the first, at every stage); `optimizer.state_dict()` saved an empty state
a resume would take for the real one; `add_param_group` added parameters no chunk holds, never trained. The engine
gives that object instance methods that raise, saying what to call instead, and removes them when it closes.
`zero_grad` stays as it was: it clears no gradient that exists, so a loop that keeps calling it loses nothing.
An LR scheduler built on the object after `initialize` wraps the refusing `step` as it would the class's (torch's
schedulers wrap `optimizer.step` to count calls), and the engine steps schedulers without calling it.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any, NoReturn

import torch

from hetero.errors import HeteroError

_INSTEAD = {
    "step": (
        "runs no update: hetero.initialize took over this optimizer and its parameters get no .grad (gradients go "
        "into hetero's chunks). Call engine.backward(loss) then engine.step() (the update happens there, at the "
        "accumulation boundary), or engine.train_batch(inputs, labels)"
    ),
    "state_dict": (
        "would be empty: hetero keeps the optimizer's states (and fp32 master weights) in chunks across tiers and "
        "ranks. Save them with engine.save_checkpoint(path) and restore them with engine.load_checkpoint(path); "
        "engine.optimizer.hyperparameters() gives the param groups' settings"
    ),
    "load_state_dict": (
        "would load into an optimizer hetero no longer steps: load a plain optimizer's state before "
        "hetero.initialize (its states are taken over), or restore a hetero checkpoint with engine.load_checkpoint"
    ),
    "add_param_group": (
        "would add parameters no hetero chunk holds, and they would never train: hetero lays its chunks out once. "
        "Build the optimizer with every param group up front (a group may start with lr 0 and be raised later, "
        "or its parameters may start with requires_grad False)"
    ),
}


def take_over(optimizer: torch.optim.Optimizer) -> Callable[[], None]:
    """Make `optimizer`'s step, state_dict, load_state_dict and add_param_group raise ([Note: the optimizer handed
    over]); returns what undoes it."""
    before = {name: optimizer.__dict__.get(name) for name in _INSTEAD}
    for name in _INSTEAD:
        setattr(optimizer, name, types.MethodType(_refusal(name), optimizer))

    def undo() -> None:
        for name, own in before.items():
            if own is None:
                optimizer.__dict__.pop(name, None)
            else:
                optimizer.__dict__[name] = own

    return undo


def _refusal(name: str) -> Callable[..., NoReturn]:
    def refuse(self: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> NoReturn:
        given = f"{type(self).__name__}.{name}() on the optimizer given to hetero.initialize"
        raise HeteroError(f"{given} {_INSTEAD[name]}")

    refuse.__name__ = name
    return refuse
