"""Typed config of the extract stage (load with `dinov3_core.config.load_config`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from omegaconf import MISSING

from dinov3_core.config import require
from dinov3_core.tracking import TrackingConfig


@dataclass
class ExtractConfig:
    """Per-tile features of a tile store → `features.zarr/slides/<id>/{cls, mean_patch, coords}`."""

    store: str = MISSING  # tile store (tiles.zarr)
    model: str = MISSING  # model.onnx (ONNX Runtime) or backbone.pth / .safetensors (PyTorch)
    output: str = MISSING  # features.zarr
    backend: Literal["auto", "onnx", "torch"] = "auto"  # auto: by the model file's suffix
    batch_size: int = 64
    patch_tokens: bool = False  # also store every patch token (N, n_patches, D) as `patch`
    slide_ids: list[str] | None = None  # null: every slide of the store
    # The µm/px level of the tile store to read, as `tile.mpp` listed it (a store tiled at several); null: the first
    # (the only one of most stores). Recorded in each slide's attributes and the run record.
    mpp: float | None = None
    # Independent processes writing one store (e.g. array jobs of a scheduler; for GPUs of one job prefer
    # `wsidino extract --nproc-per-node N`, which also splits large slides): this many processes …
    num_shards: int = 1
    shard_index: int = 0  # … of which this is one: it takes slides shard_index, shard_index + num_shards, …
    pca_map: bool = True  # pca.png per slide
    # "both": also one `<slide>.h5` per slide in `<output stem>_h5/` (features.zarr → features_h5/), in the layout
    # TRIDENT and CLAM write and attention-MIL code reads: `features` (N, D) float32 (the CLS token), `coords` (N, 2)
    # level-0 x, y with patch_size / patch_size_level0 / magnification attributes (docs/stages.md, "extract"). The
    # zarr store is always written: it is the stage's record of which slides are done, with which model.
    format: Literal["zarr", "both"] = "zarr"
    # Also `features/<slide>/tiles.geojson` for QuPath (File > Import objects): every tile a detection classified by
    # its k-means cluster among the slide's tiles (`qupath_clusters`), with PC1-3 and the cluster as measurements.
    qupath: bool = False
    qupath_clusters: int = 8
    pca_max_side: int = 768  # px of the PCA map's long side
    providers: list[str] | None = None  # ORT providers; null → CUDA when available, then CPU
    num_threads: int = 0  # torch / ORT intra-op threads; 0 → torch's default, ORT: the cores this process may use
    # Reading overlaps the model: this many threads read, decode and normalise the next batches while the model runs
    # on the current one, and one more writes the outputs behind it. 0: one thread does everything in turn (serial).
    # The features are the same either way.
    loader_threads: int = 2
    prefetch_batches: int = 2  # batches read ahead of the model (and writes pending behind it); memory ∝ this
    device: str | None = None  # torch backend: null → cuda when available, else cpu (ORT: `providers`)
    # torch backend: bf16 / fp16 autocast (for GPUs; docs/benchmarks.md has the features' difference from fp32)
    precision: Literal["fp32", "bf16", "fp16"] = "fp32"
    # torch backend (.pth / .safetensors): torch.compile the backbone (Inductor, static shapes). Inductor fuses the
    # element-wise work between the matmuls (RoPE, LayerScale, residual adds, LayerNorm) that eager runs as separate
    # kernels. Costs a warm-up of tens of seconds per process, so it pays on cohorts, not on a handful of tiles.
    # Every batch runs with batch_size rows (a slide's last, smaller batch is padded), so nothing recompiles.
    compile: bool = False
    # Rows per zarr chunk of cls / mean_patch. In a job of several ranks a slide larger than an even share of the
    # tiles is split into row ranges starting at multiples of this (of lcm(chunk_rows, batch_size) with
    # patch_tokens), so no chunk has two writers.
    chunk_rows: int = 4096
    progress: bool = True
    progress_every_s: float = 30.0  # without a terminal: a progress line (count, rate, ETA) this often
    tracking: TrackingConfig = field(default_factory=TrackingConfig)

    def __post_init__(self) -> None:
        require(self.batch_size >= 1, "batch_size", f"must be >= 1, got {self.batch_size}")
        require(1 <= self.qupath_clusters <= 12, "qupath_clusters", f"must be 1 to 12, got {self.qupath_clusters}")
        require(self.loader_threads >= 0, "loader_threads", f"must be >= 0 (0: serial), got {self.loader_threads}")
        require(self.prefetch_batches >= 1, "prefetch_batches", f"must be >= 1, got {self.prefetch_batches}")
        require(self.num_threads >= 0, "num_threads", f"must be >= 0 (0: default), got {self.num_threads}")
        require(self.num_shards >= 1, "num_shards", f"must be >= 1, got {self.num_shards}")
        onnx = self.backend == "onnx" or (self.backend == "auto" and str(self.model).lower().endswith(".onnx"))
        require(
            not (self.compile and onnx),
            "compile",
            f"applies to .pth / .safetensors models (torch backend) only, not to the ONNX model {self.model}; "
            "drop compile=true, or give the backbone.pth",
        )
        require(self.mpp is None or self.mpp > 0, "mpp", f"must be a positive µm/px or null, got {self.mpp}")
        require(self.chunk_rows >= 1, "chunk_rows", f"must be >= 1, got {self.chunk_rows}")
        require(
            0 <= self.shard_index < self.num_shards,
            "shard_index",
            f"must be in [0, num_shards) = [0, {self.num_shards}), got {self.shard_index}",
        )
