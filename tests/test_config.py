import json

import pytest

from hetero import Config, ConfigError, parse_size


@pytest.mark.parametrize(
    "text,expected",
    [
        ("2GiB", 2 << 30),
        ("512MiB", 512 << 20),
        ("1.5 GB", 1_500_000_000),
        ("1e9", 10**9),
        ("4096", 4096),
        (7, 7),
    ],
)
def test_parse_size(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("bad", ["2 parsecs", "GiB", "-1", -5, True, 1.5, [1]])
def test_parse_size_rejects(bad):
    with pytest.raises(ConfigError):
        parse_size(bad)


def test_dict_config_is_typed_and_sizes_parsed():
    c = Config.from_any(
        {
            "zero_stage": 3,
            "precision": "bf16",
            "memory": {"device_budget": "1GiB", "nvme_dir": "/tmp"},
            "offload": {"optimizer": "nvme"},
        }
    )
    assert c.zero_stage == 3 and c.memory.device_budget == 1 << 30 and c.offload.optimizer == "nvme"


def test_unknown_key_names_the_closest():
    with pytest.raises(ConfigError, match=r"unknown config key 'zero_stgae'; did you mean 'zero_stage'"):
        Config.from_any({"zero_stgae": 1})
    with pytest.raises(ConfigError, match=r"memory.device_budgte'.*did you mean 'memory.device_budget'"):
        Config.from_any({"memory": {"device_budgte": 1}})


@pytest.mark.parametrize(
    "cfg,match",
    [
        ({"zero_stage": 4}, "zero_stage: must be one of 0, 1, 2, 3"),
        ({"precision": "fp8"}, "precision: 'fp8' is not valid; choose one of 'fp32', 'bf16', 'fp16'"),
        ({"offload": {"params": "disk"}}, "offload.params: 'disk' is not valid"),
        ({"grad_accumulation_steps": 0}, "grad_accumulation_steps: expected an integer >= 1"),
        ({"grad_clip_norm": -1.0}, "grad_clip_norm: must be > 0"),
        ({"chunk_size": "big"}, "chunk_size: expected an integer >= 1"),
        ({"offload": {"optimizer": "nvme"}}, "memory.nvme_dir: offload to 'nvme' needs a directory"),
        ({"memory": {"host_budget": "lots"}}, "memory.host_budget: cannot read 'lots' as a size"),
        ({"gather_ahead": "yes"}, "gather_ahead: expected true or false, got 'yes'"),
        ({"checkpoint_patience": 0}, "checkpoint_patience: expected None .* positive number of seconds, got 0"),
        ({"checkpoint_patience": "1h"}, "checkpoint_patience: expected None .* got '1h'"),
    ],
)
def test_bad_values_say_what_is_valid(cfg, match):
    with pytest.raises(ConfigError, match=match):
        Config.from_any(cfg)


def test_config_from_json_file(tmp_path):
    p = tmp_path / "c.json"
    p.write_text(json.dumps({"zero_stage": 2, "chunk_size": 1 << 20}))
    assert Config.from_any(str(p)).zero_stage == 2
    bad = tmp_path / "bad.json"
    bad.write_text("{nope")
    with pytest.raises(ConfigError, match="not valid JSON"):
        Config.from_any(bad)
    with pytest.raises(ConfigError, match="does not exist"):
        Config.from_any(tmp_path / "missing.json")


def test_config_round_trips_through_dict():
    c = Config.from_any({"zero_stage": 1, "memory": {"host_budget": "1MiB"}})
    assert Config.from_dict(c.to_dict()) == c


@pytest.mark.parametrize("bad", ["-1", "-1GiB", " -2.5 MB", "-0.5", -1])
def test_negative_sizes_say_they_are_negative(bad):
    """A negative string is a negative size (as the int -1 is), not an unreadable one."""
    with pytest.raises(ConfigError, match=rf"memory.host_budget: a size cannot be negative, got {bad!r}"):
        parse_size(bad, key="memory.host_budget")


@pytest.mark.parametrize(
    "section,match",
    [
        ({"initial_scale": 0}, r"loss_scale.initial_scale: expected a positive number, got 0"),
        ({"initial_scale": "2**16"}, r"loss_scale.initial_scale: expected a positive number, got '2\*\*16'"),
        ({"initial_scale": float("inf")}, r"loss_scale.initial_scale: expected a positive number, got inf"),
        ({"growth_interval": 0}, r"loss_scale.growth_interval: expected an integer >= 1 \(overflow-free steps\)"),
        ({"hysteresis": 0}, r"loss_scale.hysteresis: expected an integer >= 1 \(1 halves at every overflow\), got 0"),
        ({"hysteresis": True}, r"loss_scale.hysteresis: expected an integer >= 1"),
        ({"consecutive_hysteresis": 1}, r"loss_scale.consecutive_hysteresis: expected true or false, got 1"),
        ({"deepspeed_window": "yes"}, r"loss_scale.deepspeed_window: expected true or false, got 'yes'"),
        ({"min_scale": -1}, r"loss_scale.min_scale: expected a positive number, got -1"),
        ({"min_scale": 4, "initial_scale": 2}, r"loss_scale.min_scale: 4.0 is above initial_scale 2.0"),
        ({"static": 0}, r"loss_scale.static: expected a positive number \(or None: dynamic\), got 0"),
        ({"static": 8, "hysteresis": 2, "min_scale": 2}, r"loss_scale.hysteresis/min_scale: a static scale never"),
        ({"hysteresys": 2}, r"unknown config key 'loss_scale.hysteresys'; did you mean 'loss_scale.hysteresis'"),
    ],
)
def test_loss_scale_errors_name_the_key_and_what_is_valid(section, match):
    with pytest.raises(ConfigError, match=match):
        Config.from_any({"precision": "fp16", "loss_scale": section})


def test_loss_scale_section_defaults_and_round_trip():
    c = Config.from_any({"precision": "fp16", "loss_scale": {"initial_scale": 1024, "hysteresis": 2}})
    assert (c.loss_scale.initial_scale, c.loss_scale.hysteresis, c.loss_scale.growth_interval) == (1024.0, 2, 2000)
    assert Config.from_dict(c.to_dict()) == c
    d = Config().loss_scale  # the scale hetero always had: 2**16, halved at every overflow, doubled after 2000 steps
    assert (d.initial_scale, d.growth_interval, d.hysteresis, d.min_scale, d.static) == (2.0**16, 2000, 1, 1.0, None)
    assert not d.consecutive_hysteresis and not d.deepspeed_window
    assert Config.from_any({"loss_scale": {"static": 128}}).loss_scale.static == 128.0  # read only with fp16


def test_nvme_dir_expands_the_home_folder(monkeypatch, tmp_path):
    """`~/swap` is the user's folder, as a shell (and DeepSpeed's nvme_path) reads it, not a folder named '~'."""
    monkeypatch.setenv("HOME", str(tmp_path))
    c = Config.from_dict({"memory": {"nvme_dir": "~/swap"}, "offload": {"optimizer": "nvme"}})
    assert c.memory.nvme_dir == str(tmp_path / "swap")


@pytest.mark.parametrize(
    "cfg,match",
    [
        # A float stage read as 3 by `in (0, 1, 2, 3)`, kept as 3.0 in checkpoints and messages.
        ({"zero_stage": 3.0}, r"zero_stage: must be one of 0, 1, 2, 3, got 3.0"),
        # inf passed the check and raised OverflowError from torch.distributed's join under torchrun.
        ({"comm_timeout": float("inf")}, r"comm_timeout: must be a finite number of seconds > 0, got inf"),
        # Refused before only once the model was cut over the mesh and its chunks allocated and filled.
        ({"update_in_backward": True, "parallel": {"tensor": 2}}, r"update_in_backward: .* parallel.tensor 2 / pipe"),
        ({"update_in_backward": True, "parallel": {"pipeline": 2}}, r"update_in_backward: .*pipeline 2 \(the grad"),
    ],
)
def test_contradictions_are_refused_at_the_edge(cfg, match):
    with pytest.raises(ConfigError, match=match):
        Config.from_any(cfg)


def test_update_in_backward_takes_a_sequence_split():
    # Ulysses and ring split the sequence inside the data-parallel group: no tensor group, so the update may step
    # in backward (the engine's own check reads the mesh's tensor degree, 1 there).
    c = Config.from_any({"update_in_backward": True, "parallel": {"tensor": 2, "sequence": "ulysses"}})
    assert c.update_in_backward
