"""The docs' NVMe placeholder pasted as it is, or a directory that is not there, is named as such wherever this
machine's NVMe directory is read: `tools/estimate.py --nvme-dir`, `hetero.estimate(machine=True)` and the engine's
swap store (hetero/config_values.py, `nvme_dir_problem`)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

import hetero
from hetero.config_values import nvme_dir_problem
from hetero.profiler.estimate_args import NVME_PLACEHOLDER

ROOT = Path(__file__).resolve().parent.parent
PLACEHOLDER = "is the placeholder from the docs: give a directory on your NVMe disk"
MISSING = "does not exist: give a directory on your NVMe disk"


@pytest.mark.parametrize(
    "path", [NVME_PLACEHOLDER, "/path/to/nvme", "/path/on/disk", "<nvme-dir>", "/your/nvme", "/mnt/your_nvme", "~/your"]
)
def test_placeholders_are_named(path):
    assert PLACEHOLDER in nvme_dir_problem(path)


def test_a_missing_directory_is_named_and_an_existing_one_passes(tmp_path):
    assert MISSING in nvme_dir_problem(tmp_path / "missing")
    assert nvme_dir_problem(tmp_path) is None
    (tmp_path / "file").write_text("")
    assert nvme_dir_problem(tmp_path / "file") is None  # exists: what it is, the reader of its free space says
    assert nvme_dir_problem(tmp_path / "yourself") is not None and PLACEHOLDER not in nvme_dir_problem("/data/yours")


def _estimate_main():
    spec = importlib.util.spec_from_file_location("estimate_tool", ROOT / "tools" / "estimate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main


@pytest.mark.parametrize(("where", "said"), [("placeholder", PLACEHOLDER), ("missing", MISSING)])
def test_estimate_cli_names_the_placeholder(where, said, tmp_path, capsys):
    path = NVME_PLACEHOLDER if where == "placeholder" else str(tmp_path / "missing")
    with pytest.raises(SystemExit) as stop:
        _estimate_main()(["--params", "1e6", "--offload-optimizer", "nvme", "--nvme-dir", path])
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert f"--nvme-dir: nvme_dir {path!r} {said}" in err, err


def test_estimate_on_this_machine_names_the_placeholder(tmp_path):
    config = {"zero_stage": 3, "offload": {"optimizer": "nvme"}}
    with pytest.raises(hetero.ConfigError, match=f"memory.nvme_dir '{NVME_PLACEHOLDER}' {PLACEHOLDER}"):
        hetero.estimate(1e6, {**config, "memory": {"nvme_dir": NVME_PLACEHOLDER}}, machine=True)
    with pytest.raises(hetero.ConfigError, match=MISSING):
        hetero.estimate(1e6, {**config, "memory": {"nvme_dir": str(tmp_path / "missing")}}, machine=True)
    est = hetero.estimate(1e6, {**config, "memory": {"nvme_dir": str(tmp_path)}}, machine=True)
    assert est.model_state("nvme") > 0


def test_the_engine_names_the_placeholder_a_pasted_config_carries():
    # `--recommend` prints a config with the placeholder as memory.nvme_dir, for the user to paste and edit.
    from tests.parity import build, make_optimizer

    model = build()
    config = {"zero_stage": 3, "offload": {"optimizer": "nvme"}, "memory": {"nvme_dir": NVME_PLACEHOLDER}}
    with pytest.raises(hetero.NvmeError, match=PLACEHOLDER):
        hetero.initialize(model, make_optimizer(model), config)
