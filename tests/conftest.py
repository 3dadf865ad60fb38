import pytest
import torch

from hetero.memory import ChunkManager


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture
def make_manager(tmp_path):
    """Managers that are closed at the end of the test, so swap files and threads never leak between tests."""
    made = []

    def make(**kwargs):
        kwargs.setdefault("device_budget", 1 << 30)
        kwargs.setdefault("host_budget", 1 << 30)
        if kwargs.pop("nvme", False):
            kwargs.setdefault("nvme_dir", str(tmp_path))
        m = ChunkManager(**kwargs)
        made.append(m)
        return m

    yield make
    for m in made:
        m.close()
