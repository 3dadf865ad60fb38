"""The timeline's panels: every legend beside its panel, none over the recording it labels."""

from __future__ import annotations

import pytest
from matplotlib.figure import Figure

from hetero.profiler import Profile
from tests.test_profiler import _engine, _train


@pytest.mark.timeout(240)
def test_legends_cover_no_panel(tmp_path, monkeypatch):
    engine = _engine(tmp_path)
    drawn: list[Figure] = []
    save = Figure.savefig

    def keep(fig: Figure, *args, **kwargs):
        drawn.append(fig)
        return save(fig, *args, **kwargs)

    monkeypatch.setattr(Figure, "savefig", keep)
    with Profile(engine, tmp_path / "prof"):
        _train(engine, 2)
    engine.close()
    (fig,) = drawn
    renderer = fig.canvas.get_renderer()
    panels = [ax for ax in fig.axes if ax.get_legend() is not None]
    assert len(panels) == 4  # device, host, nvme, process
    for ax in panels:
        box, legend = ax.get_window_extent(renderer), ax.get_legend().get_window_extent(renderer)
        assert not box.overlaps(legend), (ax.get_ylabel(), box, legend)
        assert legend.x1 <= fig.bbox.x1  # and inside the picture
    # A panel's legend names the kinds its tier held, not every kind of every tier (the NVMe tier holds the optimizer
    # states here, and nothing else).
    labels = {ax.get_ylabel(): [t.get_text() for t in ax.get_legend().get_texts()] for ax in panels}
    assert "optim" in labels["nvme (MiB)"] and "param" not in labels["nvme (MiB)"], labels


@pytest.mark.timeout(240)
def test_writing_the_outputs_shows_progress(tmp_path, monkeypatch, capsys):
    # Writing a long recording takes a while after its last step (the plot most): silent before, now a bar where
    # bars are shown (hetero/progress.py: a terminal, or HETERO_PROGRESS=1).
    monkeypatch.setenv("HETERO_PROGRESS", "1")
    engine = _engine(tmp_path)
    with Profile(engine, tmp_path / "prof"):
        _train(engine, 1)
    engine.close()
    assert "hetero.profile: writing" in capsys.readouterr().err
