"""Typed config of the evaluate stage (load with `dinov3_core.config.load_config`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from omegaconf import MISSING

from dinov3_core.config import require
from dinov3_core.errors import WsidinoError
from dinov3_core.evaluate.statistics import min_groups
from dinov3_core.tracking import TrackingConfig

PRIMARY_METRICS = (
    *(f"{probe}.{metric}" for probe in ("linear", "knn") for metric in ("balanced_accuracy", "macro_f1", "auroc")),
    "dense.balanced_accuracy",  # the dense probe on patch tokens (`dinov3_core.evaluate.dense`)
    "dense.miou",
)


class EvaluateError(WsidinoError):
    """Bad evaluate input: a model, the baseline, the registry or the side tables (patients, sites)."""


@dataclass
class ProbeConfig:
    """The probes and their statistics (defaults: the eva / DINOv2 protocol)."""

    features: Literal["cls", "mean_patch", "cls+mean_patch"] = "cls+mean_patch"  # what each tile is represented by
    knn_k: int = 20
    knn_temperature: float = 0.07  # votes weighted by exp(cosine similarity / T)
    linear_c: list[float] = field(default_factory=lambda: [0.01, 0.1, 1.0, 10.0])  # inverse L2 strength, swept
    few_shot: list[int] = field(default_factory=lambda: [1, 2, 4, 8, 16])  # tiles per class
    few_shot_draws: int = 5
    bootstrap: int = 1000  # resamples of the test slides for the 95 % intervals
    # Grouped cross-validation: slides (or patients) dealt into this many folds, capped at the number of groups;
    # each fold is tested by probes fitted on the others, so every slide is a test slide once.
    folds: int = 5
    seed: int = 0
    # Dense probe: at most this many labelled patch tokens per labelled tile (evenly spaced; 0: no dense probe).
    # They are kept from the tile probe's embedding pass, tiles × this × feature dims float32 in memory and cache.
    dense_tokens_per_tile: int = 16

    def __post_init__(self) -> None:
        require(self.knn_k >= 1, "knn_k", f"must be >= 1, got {self.knn_k}")
        require(self.knn_temperature > 0, "knn_temperature", f"must be > 0, got {self.knn_temperature}")
        require(bool(self.linear_c) and all(c > 0 for c in self.linear_c), "linear_c", "needs values > 0")
        require(all(n >= 1 for n in self.few_shot), "few_shot", f"tiles per class must be >= 1, got {self.few_shot}")
        require(self.few_shot_draws >= 1, "few_shot_draws", f"must be >= 1, got {self.few_shot_draws}")
        require(self.bootstrap >= 10, "bootstrap", f"must be >= 10 resamples, got {self.bootstrap}")
        n = self.dense_tokens_per_tile
        require(n >= 0, "dense_tokens_per_tile", f"must be >= 0 (0: no dense probe), got {n}")
        require(self.folds >= 2, "folds", f"must be >= 2 (every slide tested once needs two folds), got {self.folds}")


@dataclass
class StainConfig:
    """Label-free stain invariance: `tiles` health tiles re-stained by HED jitter, each must retrieve its original."""

    tiles: int = 64  # evenly spaced over the store (the health tiles' first ones)
    # Per tile a fixed scale U(1 ± σ) and shift U(± σ) of the haematoxylin / eosin / DAB stains: twice the
    # training augmentation's defaults, so a model is tested a little beyond what it was trained to ignore.
    scale_sigma: float = 0.1
    shift_sigma: float = 0.02
    seed: int = 0

    def __post_init__(self) -> None:
        require(self.tiles >= 2, "tiles", f"must be >= 2 (retrieval among one tile is trivial), got {self.tiles}")
        require(0 <= self.scale_sigma < 1, "scale_sigma", f"must be in [0, 1), got {self.scale_sigma}")
        require(self.shift_sigma >= 0, "shift_sigma", f"must be >= 0, got {self.shift_sigma}")


@dataclass
class GateConfig:
    """When the candidate becomes `@champion` in the registry."""

    promote: bool = True  # false: measure and record only, never move the alias
    primary_metric: str = "linear.balanced_accuracy"  # <probe>.<metric>, probe linear, knn or dense (mIoU too)
    # Promotion needs the paired permutation test over test slides (dinov3_core.evaluate.statistics) at p ≤ alpha
    # and the observed difference (candidate − champion) above margin. One-sided 0.025: the conventional level of a
    # one-sided claim of superiority (a two-sided 5 % test), and the level whose false-promotion rate on null pairs
    # of models stayed under 5 % (docs/evaluation.md, "Calibration").
    alpha: float = 0.025
    margin: float = 0.0
    min_effective_rank: float = 0.02  # label-free health: below this the features have collapsed
    label_free: bool = False  # without annotations, promote a healthy candidate that beats the baseline's health
    # Evidence: the test over n slides (or patient groups with patients=CSV) cannot give p < 2^-n, so below
    # ceil(log2(1 / alpha)) test slides (6 at alpha 0.025) nothing can be promoted. null: that minimum; a number
    # (at least that minimum) asks for more slides than the test needs.
    min_test_slides: int | None = None
    # Explicit opt-out: on fewer test slides than that, decide on the point estimate (difference > margin) all the
    # same; recorded in the reason and in evaluation.json. For demos and smoke runs, never for a shared registry.
    allow_point_estimate: bool = False

    def __post_init__(self) -> None:
        require(
            self.primary_metric in PRIMARY_METRICS,
            "primary_metric",
            f"must be one of {', '.join(PRIMARY_METRICS)}, got {self.primary_metric!r}",
        )
        require(
            0 <= self.min_effective_rank < 1, "min_effective_rank", f"must be in [0, 1), got {self.min_effective_rank}"
        )
        require(0 < self.alpha < 1, "alpha", f"must be in (0, 1), e.g. 0.05, got {self.alpha}")
        least = min_groups(self.alpha)
        require(
            self.min_test_slides is None or self.min_test_slides >= least,
            "min_test_slides",
            f"must be null or >= {least}: below that the permutation test cannot reach p <= alpha={self.alpha} "
            f"(its least p-value on n slides is 2^-n); gate.allow_point_estimate=true is the explicit way to decide on "
            f"less, got {self.min_test_slides}",
        )

    def required_test_slides(self) -> int:
        """Test slides (patients) the gate needs before its test can promote: `min_test_slides`, or the least n with
        2^-n <= alpha."""
        return self.min_test_slides if self.min_test_slides is not None else min_groups(self.alpha)


@dataclass
class EvaluateConfig:
    """Frozen-feature probes of the candidate, the registry's champion and a baseline on the lab's annotations."""

    store: str = MISSING  # tile store (tiles.zarr) with the annotated slides
    candidate: str = MISSING  # model.onnx (export) or backbone.pth (convert)
    output: str = MISSING  # evaluation directory: evaluation.json, pictures, feature cache
    # A folder of QuPath <slide_id>.geojson exports, or a CSV slide_id,x,y,label; null: label-free health only.
    annotations: str | None = None
    # The µm/px level of the tile store to evaluate on (a store tiled at several, `tile.mpp` a list); null: the first.
    # Recorded in evaluation.json; the feature cache tells levels apart.
    mpp: float | None = None
    min_overlap: float = 0.0  # share of a tile's area its class's polygons must cover (0: centre inside is enough)
    exclude_classes: list[str] = field(default_factory=list)  # annotation classes left out (e.g. "Ignore*")
    patients: str | None = None  # CSV slide_id,patient_id: split by patient instead of slide
    sites: str | None = None  # CSV slide_id,site: report how well the features predict the site (lower is better)
    baseline: str | None = "auto"  # weights file; auto: the released weights training started from, else "init"
    champion: bool = True  # compare with (and gate against) wsidino-backbone@champion when the registry has one
    max_tiles_per_slide: int | None = 2000  # labelled tiles kept per slide (evenly spaced), for a bounded cost
    health_tiles: int = 256  # tiles for the label-free health scores (evenly spaced over the store)
    batch_size: int = 64
    num_threads: int = 0  # torch / ONNX Runtime threads; 0: library default (a job's CPU ranks: a share of the cores)
    # The labelled tiles are embedded as extract embeds (`dinov3_core.inference.loader`): this many threads read, decode
    # and normalise the next `prefetch_batches` batches while the model runs; 0: serial. Same features either way.
    loader_threads: int = 2
    prefetch_batches: int = 2
    device: str | None = None  # torch backend: null → cuda when available, else cpu (ORT: its default providers)
    # torch backend: bf16 / fp16 autocast (the features differ slightly, so the cache and the config hash tell them
    # apart); ONNX models run as exported (export fp16=true for half precision)
    precision: Literal["fp32", "bf16", "fp16"] = "fp32"
    register_name: str = "wsidino-backbone"  # the registered model whose aliases the gate moves
    probe: ProbeConfig = field(default_factory=ProbeConfig)
    stain: StainConfig = field(default_factory=StainConfig)
    gate: GateConfig = field(default_factory=GateConfig)
    progress: bool = True
    tracking: TrackingConfig = field(default_factory=TrackingConfig)

    def __post_init__(self) -> None:
        require(0 <= self.min_overlap <= 1, "min_overlap", f"must be in [0, 1], got {self.min_overlap}")
        require(self.batch_size >= 1, "batch_size", f"must be >= 1, got {self.batch_size}")
        require(self.num_threads >= 0, "num_threads", f"must be >= 0 (0: default), got {self.num_threads}")
        require(self.loader_threads >= 0, "loader_threads", f"must be >= 0 (0: serial), got {self.loader_threads}")
        require(self.prefetch_batches >= 1, "prefetch_batches", f"must be >= 1, got {self.prefetch_batches}")
        require(self.precision in ("fp32", "bf16", "fp16"), "precision", f"fp32, bf16 or fp16, got {self.precision!r}")
        require(self.health_tiles >= 8, "health_tiles", f"must be >= 8, got {self.health_tiles}")
        require(
            self.max_tiles_per_slide is None or self.max_tiles_per_slide >= 1,
            "max_tiles_per_slide",
            f"must be >= 1 or null, got {self.max_tiles_per_slide}",
        )


__all__ = ["EvaluateConfig", "EvaluateError", "GateConfig", "ProbeConfig", "StainConfig"]
