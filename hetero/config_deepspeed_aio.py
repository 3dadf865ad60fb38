"""DeepSpeed's `aio` section, mapped onto hetero's NVMe tier (for `hetero.config_deepspeed`).

[Note: DeepSpeed's aio section on hetero's NVMe tier]
DeepSpeed's NVMe swapper submits libaio requests of `block_size` bytes from `intra_op_parallelism` threads, each
keeping up to `queue_depth` of them in flight (0.19.8's defaults: 1 MiB, 8, 1; `thread_count` was the old name of
intra_op_parallelism, which 0.19.8 no longer reads). hetero's tier (hetero/memory/nvme.py) has `io_threads` threads,
each in one blocking pwrite/preadv of `block_bytes` at a time, so it keeps io_threads requests in flight. The two
tunings that depend on the disk carry over: queue_depth x intra_op_parallelism becomes memory.nvme_io_threads (the
requests in flight; DeepSpeed's default for whichever of the two is not given) and block_size becomes
memory.nvme_block_bytes (rounded up to a multiple of 4096, O_DIRECT's alignment). Where the section gives neither,
hetero keeps its own (8 threads, 8 MiB blocks: the same 8 requests in flight as DeepSpeed's default; hetero's block is
also its unit of checksums and staging, which is why it is larger). single_submit and overlap_events choose how
DeepSpeed's threads batch submissions and reap completions: hetero's threads each wait on their own request, so there
is nothing to choose, and they are named. use_gds (GPUDirect Storage) has no path in hetero: its NVMe I/O goes
through host memory. DeepSpeed checks the section only where it uses it: its C++ handle takes integers and booleans,
and use_gds needs a CUDA accelerator (an assertion); an unknown key is ignored. Those checks are mirrored: a value
the handle cannot take (or a size below 1, with which no request is made) is refused, and an unknown key is named.
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from typing import Any

from hetero.device import gpu_count
from hetero.errors import ConfigError
from hetero.io.direct import ALIGN, align_up

# DeepSpeed 0.19.8's aio keys and defaults (deepspeed/runtime/swap_tensor/constants.py).
DS_AIO = {"block_size": 1048576, "queue_depth": 8, "intra_op_parallelism": 1, "single_submit": False,
          "overlap_events": True, "use_gds": False}  # fmt: skip
_NAMED = {
    "single_submit": "hetero's I/O threads each issue one blocking request and wait for it (memory.nvme_io_threads "
    "of them in flight): there is no batched submission to choose",
    "overlap_events": "hetero's I/O threads each wait on their own request: there are no completion events to overlap",
}


def translate_aio(aio: Any, out: dict[str, Any], notes: list[str]) -> None:
    """DeepSpeed's aio section into `out` (memory.nvme_io_threads, memory.nvme_block_bytes); the rest into `notes`."""
    if aio is None:  # DeepSpeed's defaults: hetero keeps its own
        return
    if not isinstance(aio, Mapping):
        raise ConfigError(
            f'aio: expected a section such as {{"queue_depth": 8}}, got {aio!r}; DeepSpeed refuses it too'
        )
    for key in aio:
        if key == "thread_count":
            notes.append(
                "aio.thread_count: DeepSpeed 0.19.8 reads no such key (it became intra_op_parallelism) and ignores "
                "it, and so does hetero; write intra_op_parallelism"
            )
        elif key not in DS_AIO:
            close = difflib.get_close_matches(key, list(DS_AIO), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            notes.append(f"aio.{key}: not a DeepSpeed 0.19.8 aio key{hint}; DeepSpeed ignores it, and so does hetero")
    ds = {k: aio.get(k, d) for k, d in DS_AIO.items()}
    for k in ("block_size", "queue_depth", "intra_op_parallelism"):
        v = ds[k]
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ConfigError(
                f"aio.{k}: expected an integer >= 1, got {v!r}; DeepSpeed passes it to its C++ aio handle, which "
                "takes only an integer (and makes no request with a size below 1)"
            )
    for k in ("single_submit", "overlap_events", "use_gds"):
        if not isinstance(ds[k], bool):
            raise ConfigError(
                f"aio.{k}: expected true or false, got {ds[k]!r}; DeepSpeed's aio handle takes only a boolean"
            )
    memory = out.setdefault("memory", {})
    if "queue_depth" in aio or "intra_op_parallelism" in aio:
        memory["nvme_io_threads"] = ds["queue_depth"] * ds["intra_op_parallelism"]
    if "block_size" in aio:
        memory["nvme_block_bytes"] = align_up(ds["block_size"], ALIGN)
        if ds["block_size"] % ALIGN:
            notes.append(
                f"aio.block_size: {ds['block_size']} rounded up to {memory['nvme_block_bytes']} (hetero's requests "
                f"are O_DIRECT-aligned, multiples of {ALIGN} bytes)"
            )
    notes += [f"aio.{k}: {why}" for k, why in _NAMED.items() if k in aio]
    if ds["use_gds"]:
        if gpu_count() == 0:
            raise ConfigError(
                "aio.use_gds: GPUDirect Storage needs a CUDA accelerator, and none is present; DeepSpeed refuses "
                "this too ('GDS currently only supported for CUDA accelerator'). Set use_gds to false"
            )
        notes.append(
            "aio.use_gds: hetero has no GPUDirect Storage path: its NVMe reads and writes go through host memory "
            "(staged and checksummed there)"
        )
