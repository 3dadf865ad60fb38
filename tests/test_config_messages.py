"""Config errors a new user hit, each saying what was wrong and what to give instead."""

import pytest

from hetero import Config, ConfigError


@pytest.mark.parametrize(
    ("cfg", "message"),
    [
        # A size in bytes where elements are counted: say so, and what that size is in fp32 elements.
        (
            {"chunk_size": "1MiB"},
            'chunk_size: expected an integer >= 1, a number of elements per chunk (not bytes), or "auto", got '
            "'1MiB' ('1MiB' is a size in bytes: at fp32, 4 bytes an element, that is chunk_size 262144)",
        ),
        ({"chunk_size": "4096"}, "got '4096' (a string: give the integer 4096, without quotes)"),
        ({"zero_stage": "3"}, "zero_stage: must be one of 0, 1, 2, 3, got '3' (a string: give the integer 3, without"),
        ({"zero_stage": 3.0}, "zero_stage: must be one of 0, 1, 2, 3, got 3.0 (an integer: 3, not 3.0)"),
        # A section given as a value: the form it takes.
        (
            {"offload": "nvme"},
            "offload: expected a mapping of its keys (params, optimizer, params_host_bytes, params_host_elements), "
            'e.g. {"optimizer": "nvme"} or {"params": "nvme", "optimizer": "nvme"}; got the str \'nvme\'',
        ),
        # One sentence after another: no "?;" between the closest key and the DeepSpeed hint.
        (
            {"gradient_clipping": 1.0},
            "unknown config key 'gradient_clipping'; did you mean 'grad_clip_norm'? 'gradient_clipping' is a "
            "DeepSpeed key: hetero's key is grad_clip_norm. To translate a whole DeepSpeed config, use "
            "hetero.Config.from_deepspeed(ds_config). Valid keys here: zero_stage,",
        ),
        ({"no_such_key": 1}, "unknown config key 'no_such_key'. Valid keys here: zero_stage,"),
    ],
)
def test_config_messages(cfg, message):
    with pytest.raises(ConfigError) as info:
        Config.from_dict(cfg)
    assert message in str(info.value)
    assert "?;" not in str(info.value)


def test_a_long_value_is_shortened():
    with pytest.raises(ConfigError) as info:
        Config.from_dict({"memory": "x" * 1000})
    assert str(info.value).endswith("got the str '" + "x" * 76 + "...")  # 80 characters in all
