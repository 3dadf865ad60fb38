"""DeepSpeed's NVMe settings: the aio section's queue depth and block size become the NVMe tier's own, the other aio
keys and the offload sections' swap settings are named with what hetero does instead, and every value DeepSpeed
refuses is refused ([Note: DeepSpeed's aio section on hetero's NVMe tier] in hetero/config_deepspeed_aio.py)."""

from __future__ import annotations

import logging
import math

import pytest
import torch
from torch import nn

import hetero
from hetero.config_deepspeed_zero import translate_zero
from hetero.errors import ConfigError


def _aio(aio: object, *, strict: bool = False) -> hetero.Config:
    return hetero.Config.from_deepspeed({"aio": aio, "gradient_clipping": 0}, strict=strict)


@pytest.mark.parametrize(
    ("aio", "threads", "block"),
    [
        ({}, None, None),  # nothing given: hetero's own (8 threads, 8 MiB)
        ({"queue_depth": 32}, 32, None),  # x DeepSpeed's intra_op_parallelism, 1
        ({"intra_op_parallelism": 2}, 16, None),  # x DeepSpeed's queue_depth, 8
        ({"queue_depth": 4, "intra_op_parallelism": 3, "block_size": 262144}, 12, 262144),
        ({"block_size": 1048576}, None, 1048576),
        ({"block_size": 1000}, None, 4096),  # rounded up to O_DIRECT's alignment (and named)
    ],
)
def test_aio_queue_depth_and_block_size_become_the_tiers(aio, threads, block):
    memory = _aio(aio).memory
    assert (memory.nvme_io_threads, memory.nvme_block_bytes) == (threads, block)


def test_the_engines_nvme_store_uses_them(tmp_path):
    ds = {
        "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": str(tmp_path)}},
        "aio": {"block_size": 131072, "queue_depth": 3, "intra_op_parallelism": 1},
        "gradient_clipping": 0,
    }
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 2))
    engine = hetero.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), hetero.Config.from_deepspeed(ds))
    store = engine.manager.store
    assert (store.io_threads, store.block_bytes) == (3, 131072)
    engine.backward(engine(torch.ones(4, 8)).sum())
    engine.step()  # the states went to NVMe through those settings
    assert store.used_bytes > 0
    engine.close()


def test_aio_keys_hetero_does_otherwise_are_named(caplog, monkeypatch):
    with caplog.at_level(logging.WARNING, logger="hetero.config"):
        _aio({"single_submit": False, "overlap_events": True, "thread_count": 1, "queue_dept": 8})
    assert "aio.single_submit: hetero's I/O threads each issue one blocking request" in caplog.text
    assert "aio.overlap_events: hetero's I/O threads each wait on their own request" in caplog.text
    # DeepSpeed 0.19.8 no longer reads thread_count, nor any key it does not know: both ignored, and named
    assert "aio.thread_count: DeepSpeed 0.19.8 reads no such key (it became intra_op_parallelism)" in caplog.text
    assert "aio.queue_dept: not a DeepSpeed 0.19.8 aio key (did you mean 'queue_depth'?)" in caplog.text
    with pytest.raises(ConfigError, match=r"aio.block_size: 1000 rounded up to 4096"):
        _aio({"block_size": 1000}, strict=True)
    _aio({"queue_depth": 16, "block_size": 65536, "use_gds": False}, strict=True)  # all translated: no note
    monkeypatch.setattr("hetero.config_deepspeed_aio.gpu_count", lambda: 1)
    with pytest.raises(ConfigError, match=r"aio.use_gds: hetero has no GPUDirect Storage path"):
        _aio({"use_gds": True}, strict=True)


@pytest.mark.parametrize(
    "aio",
    [
        {"block_size": 0},
        {"block_size": -4096},
        {"block_size": 1.5},
        {"block_size": "1048576"},  # DeepSpeed's C++ handle takes an int, not text
        {"block_size": "auto"},  # Hugging Face fills no aio key: DeepSpeed gets the text
        {"queue_depth": True},
        {"queue_depth": 0},
        {"intra_op_parallelism": 8.0},
        {"single_submit": "false"},
        {"overlap_events": 1},
        {"use_gds": None},
        [8],
    ],
)
def test_aio_values_deepspeed_cannot_use_are_refused(aio):
    with pytest.raises(ConfigError, match=r"^aio(\.\w+)?: expected .*DeepSpeed"):
        _aio(aio)


def test_use_gds_without_cuda_is_refused_as_deepspeed_refuses_it(monkeypatch):
    monkeypatch.setattr("hetero.config_deepspeed_aio.gpu_count", lambda: 0)
    with pytest.raises(ConfigError, match=r"aio.use_gds: GPUDirect Storage needs a CUDA accelerator.*use_gds to false"):
        _aio({"use_gds": True})
    assert _aio(None).memory.nvme_io_threads is None  # "aio": null is DeepSpeed's defaults


# (section, key, value): DeepSpeed's offload models decide whether each is refused.
OFFLOAD_VALUES = [
    (section, key, value)
    for section in ("offload_param", "offload_optimizer")
    for key, values in (
        ("buffer_count", [4, 4.0, "4", True, -1, 4.5, None, "four"]),
        ("pin_memory", [True, "false", 0, 2, "x", None]),
    )
    for value in values
] + [
    ("offload_param", "buffer_size", v) for v in [1e8, 100000000, -1, "1e8", 0.5]
] + [
    ("offload_optimizer", key, v)
    for key in ("ratio", "cpuadam_cores_perc")
    for v in [0.5, 1, True, "0.5", "1e-1", math.nan, math.inf, "nan", 1.5, -0.1, "x", None]
] + [
    ("offload_optimizer", key, v) for key in ("fast_init", "pipeline_read", "super_offload") for v in ["yes", 3]
]  # fmt: skip


@pytest.mark.parametrize(("section", "key", "value"), OFFLOAD_VALUES)
def test_offload_values_refused_where_deepspeed_refuses_them(section, key, value, tmp_path):
    offload = pytest.importorskip("deepspeed.runtime.zero.offload_config")
    model = {"offload_param": offload.DeepSpeedZeroOffloadParamConfig,
             "offload_optimizer": offload.DeepSpeedZeroOffloadOptimizerConfig}[section]  # fmt: skip
    try:
        model(**{key: value})
        refused = False
    except Exception:  # pydantic's ValidationError
        refused = True
    zero = {"stage": 3, section: {"device": "nvme", "nvme_path": str(tmp_path), key: value}}
    if refused:
        with pytest.raises(ConfigError, match=rf"zero_optimization.{section}.{key}: expected .*DeepSpeed refuses"):
            translate_zero(zero, {}, [])
    else:
        translate_zero(zero, {}, [])


def _named(section: str, device: str = "nvme", **settings: object) -> list[str]:
    """The offload settings of `section` named as not translated."""
    notes: list[str] = []
    zero = {"stage": 3, section: {"device": device, "nvme_path": "/tmp", **settings}}
    translate_zero(zero, {}, notes)
    return [n.split(":")[0].rsplit(".", 1)[1] for n in notes]


def test_offload_settings_named_only_where_hetero_does_otherwise():
    # What hetero does: pinned host buffers, every state offloaded, states streamed with their I/O overlapped.
    assert _named("offload_param", pin_memory=True, max_in_cpu=10) == []
    assert _named("offload_optimizer", pin_memory=True, ratio=1.0, pipeline_read=True, pipeline_write=True,
                  fast_init=False, super_offload=False, cpuadam_cores_perc=0.5) == []  # fmt: skip
    # What it does otherwise, each named.
    assert _named("offload_param", pin_memory=False, buffer_count=5, buffer_size=10**8) == [
        "pin_memory", "buffer_count", "buffer_size"]  # fmt: skip
    assert _named("offload_optimizer", buffer_count=4, pipeline_read=False, fast_init=True, ratio=0.3) == [
        "buffer_count", "pipeline_read", "fast_init", "ratio"]  # fmt: skip
    assert _named("offload_optimizer", super_offload=True, cpuadam_cores_perc=0.5) == [
        "super_offload", "cpuadam_cores_perc"]  # fmt: skip
    # The pipeline flags act only on NVMe's states (DeepSpeed's too): on the host nothing streams from a disk.
    assert _named("offload_optimizer", device="cpu", pipeline_read=False) == []


def test_offload_notes_say_what_hetero_does(caplog):
    ds = {"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu", "pin_memory": False,
                                                              "buffer_count": 5}}}  # fmt: skip
    with caplog.at_level(logging.WARNING, logger="hetero.config"):
        hetero.Config.from_deepspeed(ds)
    assert "offload_param.pin_memory: hetero pins its host buffers whenever CUDA is present" in caplog.text
    assert "memory.host_budget" in caplog.text
    assert "offload_param.buffer_count: hetero reads parameter chunks from NVMe into its host tier" in caplog.text
