"""Launched by tests under torchrun: hetero.initialize joins the process group from the environment."""

import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import parity  # noqa: E402

import hetero  # noqa: E402


def main() -> None:
    out_path, stage = sys.argv[1], int(sys.argv[2])
    torch.set_num_threads(1)
    model = parity.build()
    engine = hetero.initialize(model, parity.make_optimizer(model), {"zero_stage": stage, "chunk_size": parity.CHUNK})
    rank, world = engine.data_parallel_rank, engine.data_parallel_size
    assert world == int(os.environ["WORLD_SIZE"]) and rank == int(os.environ["RANK"])
    local = 4 // world
    losses = []
    for x, y in parity.batches(4, 4):
        loss = engine(x[rank * local : (rank + 1) * local], labels=y[rank * local : (rank + 1) * local]).loss
        engine.backward(loss)
        engine.step()
        mean = loss.detach().clone()
        engine.comm.control.all_reduce(mean, op="avg")  # a host scalar: the control group
        losses.append(mean.item())
    state = engine.full_state_dict()
    if rank == 0:
        torch.save({"losses": losses, "state": state}, out_path)
        print(json.dumps({"losses": losses}))
    engine.close()


if __name__ == "__main__":
    main()
