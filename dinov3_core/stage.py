"""What a stage is: the one object that holds everything the runner, the chains (pipeline, retrain), the CLI and
the Prefect layer need to know about it. Each stage module (`dinov3_core.stages.<stage>`) builds one `Stage`;
`dinov3_core.stages.STAGES` lists them in order. Nothing here knows a particular stage, and this module sits below
every stage's own code: the summaries a stage's manifest keeps (`Summary`) are defined beside that code
(`dinov3_core/<package>/summary.py`), so other packages read them typed without importing the stages.

    stage = get_stage("export")
    stage.inputs(cfg)          # {"weights": "/run/model/backbone.pth"}
    stage.manifest_path(cfg)   # /run/model/model.onnx.stage_manifest.json
    stage.chain_values(paths)  # the config keys a pipeline or a cycle sets for it
    paths.output("export")     # <cycle dir>/model/model.onnx: where the stage's `place` puts it in this chain
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Generic, Literal, TypeVar

from dinov3_core import manifest as mf
from dinov3_core.config import config_hash
from dinov3_core.config_tree import flat_params

GuardFactory = Callable[[Any], contextlib.AbstractContextManager[Any]]


# ------------------------------------------------------------------------------------------------ typed summaries


@dataclass
class Summary:
    """The figures a stage's manifest keeps (`summary` in stage_manifest.json), typed. Fields left None are not
    written; keys a newer or older version wrote and this one does not know are ignored when read back.

    The methods below are what the chains and reports ask of any stage's summary; a stage answers those that
    concern it, so no caller needs to know which stage it holds."""

    def to_json(self) -> dict[str, Any]:
        """The JSON object the manifest stores."""
        return {k: v for k, v in dataclasses.asdict(self).items() if v is not None}

    @classmethod
    def from_json(cls, values: Mapping[str, Any] | None) -> Any:
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in (values or {}).items() if k in names})

    @property
    def failures(self) -> int:
        """Items of the stage's input that failed (tile: slides); a command exits 1 when this is not 0."""
        return 0

    def unusable(self) -> str | None:
        """Why the stages after this one cannot use what it left (a chain stops there); None: they can."""
        return None

    def note(self) -> str:
        """A few words the pipeline's closing summary adds to the stage's output line (e.g. the registered
        version)."""
        return ""

    def health_report(self) -> str | None:
        """A training run's health verdict and last figures (the pipeline's "training health"); None: not a
        training stage."""
        return None

    def verdict(self) -> str | None:
        """A decision the run made, in one line (evaluate: the gate's evidence line)."""
        return None


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
class Place:
    """Where a stage's output goes in a chain: `name` under the chain's root (`scope="cohort"`: one output the whole
    cohort shares, e.g. the tile store a retraining cycle adds to) or under the run's own directory
    (`scope="cycle"`: a cycle's models). In a pipeline both are the work directory."""

    name: str  # a file or directory name, e.g. "tiles.zarr", "model/model.onnx"
    scope: Literal["cohort", "cycle"] = "cycle"
    contents: str = ""  # what a user finds there, for the pipeline's closing summary


@dataclass(frozen=True)
class ChainPaths:
    """What a chain (a pipeline's work directory, a retraining cycle) decides for its stages: where their outputs
    go (`root`, `cycle_dir`, each stage's `Place`) and what only the chain knows by the time a stage runs (the
    warm-start weights, a cycle's snapshot, the model to extract with). A stage turns this into its config keys
    (`Stage.chain_values`); the user cannot override them.
    """

    root: Path  # cohort-wide outputs (a pipeline: the work directory; a cycle: its retraining root)
    cycle_dir: Path  # the run's own outputs (a pipeline: the work directory; a cycle: cycles/<id>/)
    slides: str
    runs: tuple[str, ...]  # the stages of this chain (convert reads the gram run only when gram anchoring runs)
    annotations: str | None = None
    register_name: str | None = None  # a cycle registers under its retrain config's name (a pipeline: the default)
    weights: str | None = None  # warm start of pretrain (None: the pretrain config's own, unless decided)
    weights_decided: bool = False  # a cycle decided the warm start: None then means from scratch
    slide_ids: list[str] | None = None  # a cycle trains and extracts on its snapshot's slides only
    extract_model: str | None = None  # the model extract uses (None: this chain's exported model)
    places: Mapping[str, Place] = field(default_factory=dict)  # every stage's `place` (`dinov3_core.chain`)
    placed: Mapping[str, Path] = field(default_factory=dict)  # stage → an output the chain puts elsewhere

    def output(self, stage: str) -> Path:
        """Where `stage` writes in this chain."""
        if stage in self.placed:
            return self.placed[stage]
        place = self.places[stage]
        return (self.root if place.scope == "cohort" else self.cycle_dir) / place.name

    def named(self) -> dict[str, Path]:
        """Every stage's output by stage name, in chain order (the pipeline summary's `paths`)."""
        return {name: self.output(name) for name in self.runs}


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
    schema: Callable[[], type]  # the typed config class (a callable: pretrain's pulls in torch)
    summary_type: type[S]
    output: Callable[[Any], str]  # the config's output path
    output_is_dir: bool
    place: Place  # where a chain puts that output
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
    # Reads the input before a chain writes anything: a ConfigError naming what is wrong (tile: no slide there).
    check_input: Callable[[Any], None] | None = None
    # Checks before any work of a chain starts: problems with the keys as the stage itself names them.
    preflight: Callable[[Any, PreflightFacts], list[Problem]] | None = None
    # How long the stage will take at least on this machine, for a world size (`train.duration.Duration`; None:
    # unknown): a chain says it before a long run and asks before a very long one (`chain.check_duration`).
    duration: Callable[[Any, int], Any] | None = None
    # MLflow logging after the work, for a stage whose run opens on a thread while it works (tile).
    log_after_work: Callable[[Any, Any], None] | None = None
    after_run: Callable[[Any, mf.StageManifest], None] | None = None  # with the stage's MLflow run still open
    # CLI
    options: tuple[CliOption, ...] = ()
    launch_help: str | None = None  # "training", "extraction": the CLI offers --nproc-per-node etc.
    default_config: str | None = None  # the named config when none is given, alone and in a chain
    override_example: str = ""
    epilog: str | None = None
    rerun_hint: str = "resume from the last checkpoint"
    # When the stage reports its tiles done through `RunHooks.progress` (the CLI draws a bar, Prefect an artifact):
    # "always", or "as_job" (a job's ranks count; in this process the stage draws its own bar).
    progress: Literal["always", "as_job"] | None = None
    reports_slides: bool = False  # calls `RunHooks.on_slide` with each slide's outcome as it finishes
    report: Callable[[Any], str] | None = None  # what the CLI prints of the stage function's result at the end
    review: Callable[[Any], str] | None = None  # markdown a reviewer reads first (Prefect: the `<stage>` artifact)
    mlflow_artifacts: Callable[[Any], list[tuple[Path, str]]] | None = None  # pictures worth a look: (file, folder)

    def as_job(self, launch: Any) -> bool:
        """Runs as a torchrun job with these `LaunchSettings` (None: the defaults, one process). A launch that names
        its GPUs is a job even with one process: only a job gets its own CUDA_VISIBLE_DEVICES."""
        if self.always_job:
            return True
        if self.job_module is None or launch is None:
            return False
        return launch.world_size > 1 or bool(launch.cuda_visible_devices)

    def shows_progress(self, launch: Any) -> bool:
        """The stage reports its progress through `RunHooks.progress` with these `LaunchSettings`."""
        return self.progress == "always" or (self.progress == "as_job" and self.as_job(launch))

    def torchrun_job(self, cfg: Any, launch: Any, env: Mapping[str, str] | None = None) -> Any:
        """The stage's `TorchrunJob` for its resolved config and `LaunchSettings`.

        The config is written to `<job dir>/launch_config.yaml`, which every rank loads; `env` is extra environment
        for every rank (the MLflow run to join). Bad parallelism settings fail here with the keys to change
        (exit code 2), before torchrun starts a rank."""
        from dinov3_core.config import save_config
        from dinov3_core.launch.job import LAUNCH_CONFIG, TorchrunJob

        assert self.job_module is not None and self.job_dir is not None, f"{self.name} has no torchrun job"
        if self.job_check is not None:
            self.job_check(cfg, launch.world_size)
        where = self.job_dir(cfg)
        cfg_path = save_config(cfg, where / LAUNCH_CONFIG)
        return TorchrunJob(
            module=self.job_module,
            args=["--config", str(cfg_path.resolve())],
            nproc_per_node=launch.nproc_per_node,
            nnodes=launch.nnodes,
            rdzv_endpoint=launch.rdzv_endpoint,
            rdzv_id=f"wsidino-{self.name}-{where.name}",
            cuda_visible_devices=launch.cuda_visible_devices,
            env=dict(env or {}),
            log_dir=where / "torchrun_logs",
            timeout_s=launch.timeout_hours * 3600 if launch.timeout_hours else None,
        )

    def manifest_path(self, cfg: Any) -> Path:
        return mf.manifest_path(self.output(cfg), is_dir=self.output_is_dir)

    def decide(self, cfg: Any) -> tuple[dict[str, dict[str, str]], mf.Decision]:
        """Fingerprint the inputs and compare them and the config with the manifest: (inputs, decision)."""
        inputs = mf.fingerprint_inputs(self.inputs(cfg))
        failed = self.failed_items
        return inputs, mf.check_up_to_date(self.manifest_path(cfg), self.config_hash(cfg), inputs, failed)

    def failed_items(self, summary: Mapping[str, Any]) -> int:
        """How many items of its input a run failed on, from its manifest's summary (a rerun retries them)."""
        return self.summary(summary).failures

    def config_hash(self, cfg: Any) -> str:
        volatile = [k for k in flat_params(cfg) if any(k == v or k.startswith(v) for v in self.volatile)]
        return config_hash(cfg, exclude=volatile)

    def summary(self, values: Mapping[str, Any] | None) -> S:
        """A manifest's summary, typed."""
        return self.summary_type.from_json(values)

    def __str__(self) -> str:
        return self.name


@dataclass(frozen=True)
class PreflightFacts:
    """What a stage's checks before work get from where they run (a chain, or the stage's own command)."""

    tile_store: Path | None = None  # the chain's tile store (a training config that names none reads it)
    world_size: int = 1  # processes of a training job
    prefix: str = ""  # how the user names the stage's keys: "gram." in a chain, nothing for the stage alone
    slides: Mapping[str, str] | None = None  # the chain's slides by the id the tile stage gives them
    tiling: Any = None  # the chain's tile config (tile size, µm/px, tissue mask) the slides will be cut with
    log: Callable[[str], None] | None = None  # what a check found that is worth saying (counts, not problems)

    def key(self, key: str) -> str:
        """A config key as the user types it where the check runs (`gram.train.global_batch_size`)."""
        return self.prefix + key


def stores_input(cfg: Any) -> dict[str, str | None]:
    """The tile stores of a training config as manifest inputs."""
    return {f"tile_store[{i}]" if i else "tile_store": s for i, s in enumerate(cfg.data.stores)}


__all__ = [
    "ChainPaths",
    "CliOption",
    "Place",
    "PreflightFacts",
    "Problem",
    "RunHooks",
    "Stage",
    "Summary",
    "stores_input",
]
