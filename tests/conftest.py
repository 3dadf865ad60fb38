import os
from concurrent.futures import Executor, Future

# [Note: one intra-op thread in the tests]
# CI runs three tests at a time on two cores, each test's ranks in processes of their own. A process left at torch's
# default (a thread per core) made its OpenMP threads spin against the others': tests/test_dynamic_use.py's plain
# PyTorch references (a 16-wide model) took 82 s there, 6 s on one thread, and its test 64-77 s of the suite's
# ~1200. Set before torch is imported, so that the processes tests start (subprocesses, torchrun, the fork server's
# ranks) inherit it too and an in-process run and a fresh process sum in the same order. A benchmark or test that
# wants more threads sets them itself.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from hetero.memory import ChunkManager, moves
from tests import hf_float64

hf_float64.install()  # [Note: float64 references keep their loss in float64]


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture(autouse=True)
def _threads():
    """Tests that set torch's intra-op threads (to keep a loaded machine from stalling them) give the count back:
    a later test comparing an in-process run with a fresh subprocess bit for bit would otherwise sum in another
    order (tests/test_checkpoint_kill.py after tests/test_delayed.py differed in the last bit of a loss)."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


@pytest.fixture(autouse=True)
def _no_failed_collective():
    """A test that made a wait fail in this process leaves later ones free to reuse chunk memory ([Note: memory a
    failed collective may still write] in hetero/comm/rules.py is about one job, not a test session)."""
    from hetero.comm import rules

    yield
    rules.FAILED.clear()


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


@pytest.fixture
def cpu_device(monkeypatch):
    """A test of what hetero does on a CPU device (the device tier in host memory: borrowed pool buffers, chunks read
    in place with O_DIRECT, the CPU's ledgers) runs on the CPU whatever the machine: an engine or manager built
    without a device takes the CPU, not a GPU, and not the stand-in (HETERO_STANDIN=1 runs the rest of the suite as if
    on a GPU). Processes the test starts inherit only the stand-in's absence: hide the GPUs from them with
    `tests.dist.cpu_ranks_env` (spawned gloo ranks hide them themselves). Not hidden here: a process that has not
    touched CUDA yet would keep them hidden for the tests after this one. Returns the device to name."""
    import hetero.device

    monkeypatch.delenv("HETERO_STANDIN", raising=False)
    monkeypatch.setattr(hetero.device, "default_device", lambda: torch.device("cpu"))
    return "cpu"


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "ranks_apart(why): a multi-rank test one rank cannot stand for, skipped under HETERO_TESTS_ONE_RANK"
    )


def pytest_collection_modifyitems(config, items):
    """[Note: tests no one rank can stand for] in tests/dist.py."""
    if not os.environ.get("HETERO_TESTS_ONE_RANK"):
        return
    for item in items:
        mark = item.get_closest_marker("ranks_apart")
        if mark is not None:
            if not mark.args or not isinstance(mark.args[0], str):
                raise pytest.UsageError(f"{item.nodeid}: ranks_apart needs its reason")
            item.add_marker(pytest.mark.skip(reason=f"one rank cannot stand for several: {mark.args[0]}"))


def pytest_runtest_logreport(report):
    """`HETERO_FAILURES=FILE`: each failure's traceback is appended to FILE as it happens (in the controlling process
    under xdist), so a run cut short by a timeout (tools/gpu_check.sh on a lent GPU) still says why tests failed."""
    path = os.environ.get("HETERO_FAILURES")
    if path and report.failed and os.environ.get("PYTEST_XDIST_WORKER") is None:
        with open(path, "a") as f:
            f.write(f"==== {report.nodeid} ({report.when})\n{report.longreprtext}\n\n")


class _Copies(Executor):
    """The move workers, on the driving thread: `at_once`, or held until it waits for a move. Where a test's count
    depends on whether a copy landed before the manager looked again, forcing one ordering makes it exact."""

    def __init__(self) -> None:
        self.at_once = False
        self.held: list[tuple[Future, object, tuple]] = []

    def submit(self, fn, /, *args, **kwargs):
        future: Future = Future()
        self.held.append((future, fn, args))
        if self.at_once:
            self.release()
        return future

    def release(self) -> None:
        while self.held:
            future, fn, args = self.held.pop(0)
            try:
                future.set_result(fn(*args))
            except BaseException as e:
                future.set_exception(e)


@pytest.fixture
def copies(monkeypatch):
    """Every manager made in the test copies on the driving thread through one `_Copies` (see there)."""
    made = _Copies()
    monkeypatch.setattr(moves, "ThreadPoolExecutor", lambda *a, **k: made)
    real_wait = moves.wait

    def wait(futures, *a, **k):  # the driving thread waits for a move: what is held runs now, in order
        made.release()
        return real_wait(futures, *a, **k)

    monkeypatch.setattr(moves, "wait", wait)
    yield made
    # A test that failed with copies held: run them, or closing its managers (after this teardown: the real `wait`
    # back) would wait for them for ever.
    made.at_once = True
    made.release()
