"""What a stage is: the one object that holds everything the runner, the chains (pipeline, retrain), the CLI and
the Prefect layer need to know about it. Each stage module (`dinov3_core.stages.<stage>`) builds one `Stage`;
`dinov3_core.stages.STAGES` lists them in order. Nothing here knows a particular stage.

    stage = get_stage("export")
    stage.inputs(cfg)          # {"weights": "/run/model/backbone.pth"}
    stage.manifest_path(cfg)   # /run/model/model.onnx.stage_manifest.json
    stage.chain_values(paths)  # the config keys a pipeline or a cycle sets for it
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Generic, TypeVar

from dinov3_core import manifest as mf
from dinov3_core.config import config_hash
from dinov3_core.config_tree import flat_params

GuardFactory = Callable[[Any], contextlib.AbstractContextManager[Any]]


# ------------------------------------------------------------------------------------------------ typed summaries


@dataclass
class Summary:
    """The figures a stage's manifest keeps (`summary` in stage_manifest.json), typed. Fields left None are not
    written; keys a newer or older version wrote and this one does not know are ignored when read back."""

    def as_dict(self) -> dict[str, Any]:
        return {k: v for k, v in dataclasses.asdict(self).items() if v is not None}

    @classmethod
    def from_dict(cls, values: Mapping[str, Any] | None) -> Any:
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in (values or {}).items() if k in names})

    @property
    def failures(self) -> int:
        """Items of the stage's input that failed (tile: slides); a command exits 1 when this is not 0."""
        return 0


S = TypeVar("S", bound=Summary)


# ------------------------------------------------------------------------------------------- what callers add


@dataclass
class RunHooks:
    """What the caller adds around a stage run (the CLI and the Prefect task fill different parts)."""

    log: Callable[[str], None] = print
    parent_run_id: str | None = None  # the pipeline's MLflow run: the stage's run nests under it
    tags: Mapping[str, str] = field(default_factory=dict)  # extra MLflow tags (the Prefect flow run)
    run_name: str | None = None  # MLflow run name; default: the stage name
    hold_resources: GuardFactory | None = None  # entered around a torchrun job (Prefect GPU slots)
    progress: Callable[[int, int], None] | None = None  # tile, extract: (tiles done, tiles planned so far)
    on_slide: Callable[[Any], None] | None = None  # tile: each slide's SlideOutcome as it finishes
    run_groups: Any = None  # tile: a `tiling.groups.RunGroups` (slide groups on a Dask cluster); None: the pool
    # Runs a stage's `TorchrunJob` (pretrain, gram, extract on several processes): None → `run_torchrun` on this
    # host; a cluster backend submits it to its scheduler instead (tasks.launch_slurm.SlurmRunner).
    run_job: Callable[..., None] | None = None
    launch: Any = None  # the stage's `LaunchSettings`: evaluate embeds as a torchrun job when it asks for > 1 process


# ------------------------------------------------------------------------------------ where a chain puts things


@dataclass(frozen=True)
class ChainPaths:
    """Where each stage of one chain (a pipeline's work directory, a retraining cycle) reads and writes, and what
    only the chain knows by the time a stage runs (the warm-start weights, a cycle's snapshot, the model to
    extract with). A stage turns this into its config keys (`Stage.chain_values`); the user cannot override them.
    """

    slides: str
    tile_store: Path
    pretrain: Path
    gram: Path
    model_dir: Path
    evaluation: Path
    features: Path
    annotations: str | None = None
    gram_anchoring: bool = True
    register_name: str | None = None  # a cycle registers under its retrain config's name (a pipeline: the default)
    weights: str | None = None  # warm start of pretrain (None: the pretrain config's own, unless decided)
    weights_decided: bool = False  # a cycle decided the warm start: None then means from scratch
    slide_ids: list[str] | None = None  # a cycle trains and extracts on its snapshot's slides only
    extract_model: str | None = None  # the model extract uses (None: this chain's model.onnx)

    @property
    def backbone(self) -> Path:
        return self.model_dir / "backbone.pth"

    @property
    def onnx(self) -> Path:
        return self.model_dir / "model.onnx"

    def named(self) -> dict[str, Path]:
        """Every location by name (the pipeline summary's `paths`)."""
        return {
            "tile_store": self.tile_store,
            "pretrain": self.pretrain,
            "gram": self.gram,
            "model_dir": self.model_dir,
            "backbone": self.backbone,
            "onnx": self.onnx,
            "evaluation": self.evaluation,
            "features": self.features,
        }


# ------------------------------------------------------------------------------------------------- the stage


@dataclass(frozen=True)
class CliOption:
    """A `wsidino <stage>` option that sets one config key (`--output-dir DIR` → output_dir)."""

    flag: str
    key: str
    help: str
    repeat: bool = False  # `--store A --store B` → a list
    type: Callable[[str], Any] = str


@dataclass(frozen=True)
class Problem:
    """One thing that will fail, found before the work starts: the key as the user types it, what is wrong, and a
    value or action that works."""

    key: str
    message: str
    fix: str

    def __str__(self) -> str:
        return f"{self.key}: {self.message}; {self.fix}"


@dataclass(frozen=True)
class Stage(Generic[S]):
    """One stage: its config, inputs and outputs (the manifest's business), how it runs, what it reports, where a
    chain puts it and how the CLI offers it."""

    name: str
    help: str  # one line: what it turns into what (CLI, docs)
    schema: Callable[[], type]  # the typed config class (a callable: pretrain's pulls in torch, ~2 s)
    summary_type: type[S]
    output: Callable[[Any], str]  # the config's output path
    output_is_dir: bool
    inputs: Callable[[Any], dict[str, Any]]  # input name → path (None: not used by this config) or a StateInput
    outputs: Callable[[Any], dict[str, str]]  # after a successful run: name → path that must exist
    chain_values: Callable[[ChainPaths], dict[str, Any]]  # the config keys a pipeline / cycle sets itself
    # In this process: (the stage function's own result, the summary). None: a torchrun job only.
    work: Callable[[Any, RunHooks], tuple[Any, S]] | None = None
    job_module: str | None = None  # `python -m` on every rank when the stage runs as a torchrun job
    always_job: bool = False  # pretrain, gram: always a torchrun job (else only when the launch asks, see as_job)
    job_dir: Callable[[Any], Path] | None = None  # where a job keeps its launch config and rank logs
    job_summary: Callable[[Any], S] | None = None  # the summary once a job is done (read from what it wrote)
    job_check: Callable[[Any, int], None] | None = None  # settings checked for a world size before torchrun
    # Wraps the job's log when the caller follows progress: the whole job's count with each line rank 0 prints.
    job_log: Callable[[Any, RunHooks], Callable[[str], None]] | None = None
    volatile: tuple[str, ...] = ("tracking.", "progress")  # config keys (prefixes) that do not change outputs
    # Checks that must pass before the manifest is written into the output (tile: the output is a tile store).
    check: Callable[[Any], None] | None = None
    # Checks before any work of a chain starts: problems with the keys as the stage itself names them.
    preflight: Callable[[Any, PreflightFacts], list[Problem]] | None = None
    # MLflow logging after the work, for a stage whose run opens on a thread while it works (tile).
    log_after_work: Callable[[Any, Any], None] | None = None
    after_run: Callable[[Any, mf.StageManifest], None] | None = None  # with the stage's MLflow run still open
    # CLI
    options: tuple[CliOption, ...] = ()
    launch_help: str | None = None  # "training", "extraction": the CLI offers --nproc-per-node etc.
    default_config: str | None = None
    override_example: str = ""
    epilog: str | None = None
    rerun_hint: str = "resume from the last checkpoint"
    progress_bar: bool = False  # the CLI draws a tile bar (tile always; extract when it runs as a job)
    report: Callable[[Any], str] | None = None  # what the CLI prints of the stage function's result at the end
    mlflow_artifacts: Callable[[Any], list[tuple[Path, str]]] | None = None  # pictures worth a look: (file, folder)

    def as_job(self, launch: Any) -> bool:
        """Runs as a torchrun job with these `LaunchSettings` (None: the defaults, one process). A launch that names
        its GPUs is a job even with one process: only a job gets its own CUDA_VISIBLE_DEVICES."""
        if self.always_job:
            return True
        if self.job_module is None or launch is None:
            return False
        return launch.world_size > 1 or bool(launch.cuda_visible_devices)

    def manifest_path(self, cfg: Any) -> Path:
        return mf.manifest_path(self.output(cfg), is_dir=self.output_is_dir)

    def decide(self, cfg: Any) -> tuple[dict[str, dict[str, str]], mf.Decision]:
        """Fingerprint the inputs and compare them and the config with the manifest: (inputs, decision)."""
        inputs = mf.fingerprint_inputs(self.inputs(cfg))
        return inputs, mf.check_up_to_date(self.manifest_path(cfg), self.config_hash(cfg), inputs)

    def config_hash(self, cfg: Any) -> str:
        volatile = [k for k in flat_params(cfg) if any(k == v or k.startswith(v) for v in self.volatile)]
        return config_hash(cfg, exclude=volatile)

    def summary(self, values: Mapping[str, Any] | None) -> S:
        """A manifest's summary, typed."""
        return self.summary_type.from_dict(values)

    def __str__(self) -> str:
        return self.name


@dataclass(frozen=True)
class PreflightFacts:
    """What a stage's checks before work get from where they run (a chain, or the stage's own command)."""

    tile_store: Path | None = None  # the chain's tile store (a training config that names none reads it)
    world_size: int = 1  # processes of a training job
    prefix: str = ""  # how the user names the stage's keys: "gram." in a chain, nothing for the stage alone

    def key(self, key: str) -> str:
        """A config key as the user types it where the check runs (`gram.train.global_batch_size`)."""
        return self.prefix + key


def stores_input(cfg: Any) -> dict[str, str | None]:
    """The tile stores of a training config as manifest inputs."""
    return {f"tile_store[{i}]" if i else "tile_store": s for i, s in enumerate(cfg.data.stores)}


__all__ = [
    "ChainPaths",
    "CliOption",
    "PreflightFacts",
    "Problem",
    "RunHooks",
    "Stage",
    "Summary",
    "stores_input",
]
