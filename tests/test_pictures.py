"""The pictures a pathologist or an ML engineer reads: evaluate's confusion matrix and the training-health plot
(the tile QC picture: tests/test_tile_stage.py; extract's PCA map: tests/test_extract.py)."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from PIL import Image

from dinov3_core.config import load_config
from dinov3_core.evaluate.report import normalised_confusion, plot_confusion, short_label
from dinov3_core.train import metrics as M


def test_confusion_rows_are_shares_of_the_true_class(tmp_path):
    classes = np.array(["Squamous epithelium", "Stroma", "Tumor", "Necrosis"])
    y = np.array(["Tumor"] * 6 + ["Stroma"] * 3 + ["Squamous epithelium"])
    predicted = np.array(["Tumor"] * 4 + ["Stroma"] * 2 + ["Stroma", "Tumor", "Tumor", "Squamous epithelium"])
    share, counts = normalised_confusion(y, predicted, classes)
    assert counts.sum() == len(y) and counts[2].tolist() == [0, 2, 4, 0]
    np.testing.assert_allclose(share[:3].sum(axis=1), 1.0)
    assert share[3].sum() == 0, "a class without tiles stays a row of zeros, not NaN"
    np.testing.assert_allclose(share[1], [0, 1 / 3, 2 / 3, 0])
    drawn = plot_confusion(tmp_path / "c.png", y, predicted, classes, "candidate (backbone.pth)\nlinear probe")
    np.testing.assert_array_equal(drawn, share)
    with Image.open(tmp_path / "c.png") as im:
        assert im.width > 400 and im.height > 400
    assert short_label("Squamous epithelium") == "Squamous\nepithelium"
    assert max(len(line) for line in short_label("a very long class name that goes on " * 3).split("\n")) <= 14


def test_health_plot_from_a_real_run(pretrain_run, tmp_path):
    from dinov3_core.train.config import PretrainConfig

    cfg = load_config(PretrainConfig, pretrain_run / "config.yaml", {})
    k = cfg.heads.dino.n_prototypes
    path = pretrain_run / "training_metrics.json"
    rows = [r for r in M.read_metrics(path) if "event" not in r]
    series = M.health_series(path, k)
    its, gaps = series["dino_gap"]
    assert its == [r["iteration"] for r in rows]
    np.testing.assert_allclose(gaps, [math.log(k) - r["dino_global_loss"] for r in rows], rtol=0, atol=1e-5)
    # A file without the logged gap (older runs): computed from the loss and K; without K, no gap at all.
    bare = tmp_path / "old.json"
    bare.write_text("".join(json.dumps({x: v for x, v in r.items() if x != "dino_gap"}) + "\n" for r in rows))
    np.testing.assert_allclose(M.health_series(bare, k)["dino_gap"][1], gaps, atol=1e-5)
    assert "dino_gap" not in M.health_series(bare)
    entropy = series["teacher_entropy"][1]
    assert all(0 <= e <= 1 + 1e-6 for e in entropy)
    assert series["effective_rank"][0] == [r["iteration"] for r in rows if "effective_rank" in r] != []
    out = M.plot_loss_curve(
        path, tmp_path / "loss.png", "pretrain", "work/pretrain", k, cfg.health.min_gap, cfg.health.min_effective_rank
    )
    assert out is not None and out.is_file()
    # The run's own picture, written by the training loop: the health row under the losses (taller than before).
    with Image.open(pretrain_run / M.LOSS_CURVE_FILE) as im:
        assert im.height >= 700


@pytest.mark.parametrize("name", ["run", None])
def test_loss_curve_title_names_the_run(tmp_path, name, monkeypatch):
    run = tmp_path / "proj" / "pretrain"
    run.mkdir(parents=True)
    (run / "training_metrics.json").write_text(json.dumps({"iteration": 0, "total_loss": 1.0, "lr": 0.1}) + "\n")
    titles: list[str] = []
    import matplotlib.figure

    original = matplotlib.figure.Figure.suptitle
    monkeypatch.setattr(
        matplotlib.figure.Figure, "suptitle", lambda self, t, **kw: titles.append(t) or original(self, t, **kw)
    )
    assert M.plot_loss_curve(run / "training_metrics.json", tmp_path / "l.png", "pretrain", name) is not None
    assert titles[0].startswith(f"pretrain run {name or 'proj/pretrain'}:")


def test_embedding_map_title_and_legend_fit_inside_the_picture(tmp_path):
    """A long model description and long slide names: the title wraps and the legend sits beside the map, both
    inside the saved picture (nothing cut off at its edges)."""
    import matplotlib.pyplot as plt

    from dinov3_core.evaluate.report import embedding_figure

    rng = np.random.default_rng(0)
    slides = np.repeat([f"hospital_{k}_scanner_with_a_long_name_{k}" for k in range(12)], 5)
    title = "candidate (wsidino-backbone version 12, vit_base fine-tuned on the lab cohort): PCA of tile features"
    fig = embedding_figure(rng.normal(size=(len(slides), 2)), slides, title, "slide")
    fig.savefig(tmp_path / "e.png", dpi=110)
    renderer = fig.canvas.get_renderer()
    inside = fig.bbox
    ax = fig.axes[0]
    for artist in (ax.title, ax.get_legend()):
        box = artist.get_window_extent(renderer)
        assert inside.x0 <= box.x0 and box.x1 <= inside.x1 and inside.y0 <= box.y0 and box.y1 <= inside.y1, artist
    assert "\n" in ax.get_title()
    assert len(ax.get_legend().get_texts()) == 12
    plt.close(fig)
