"""What every experiment run records, and where: provenance files, the job's device, and wandb.

- :func:`write_run_files`: ``config.yaml`` (the resolved, typed config), ``run_info.json`` (git commit,
  package versions, seeds, device, command line, Hydra overrides) in the run directory; the entry points
  add ``summary.json``.
- :func:`pick_device`: the device of a job. An explicit ``engine.device`` wins; inside a Ray task the
  job takes CUDA exactly when Ray granted it GPUs (``hydra.launcher.ray.remote.num_gpus``), else the
  CPU; elsewhere CUDA when available.
- :class:`Tracker`: ``logger=none`` gives :class:`NullTracker` (creates nothing); ``logger=wandb`` gives
  :class:`WandbTracker`: config, per-step and summary metrics and figures, offline by default, one wandb
  run per job, finished by the job.
- :func:`read_offline_run`: the config, history and summary of an offline wandb run, read back from its
  ``.wandb`` file without the network (for tests, and to inspect a run before ``wandb sync``).
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from collections.abc import Callable, Mapping
from importlib import metadata
from pathlib import Path
from typing import Any, Protocol, TypeVar

from experiments.config import LoggerConfig, WandbLoggerConfig

T = TypeVar("T")

#: Distributions whose versions every run records (absent ones are recorded as null).
RECORDED_DISTRIBUTIONS = (
    "specdec",
    "torch",
    "transformers",
    "tokenizers",
    "hydra-core",
    "omegaconf",
    "numpy",
    "matplotlib",
    "wandb",
    "ray",
    "hydra-ray-launcher",
    "hydra-submitit-launcher",
    "outlines-core",
)


# ------------------------------------------------------------------------------------ provenance
def git_commit() -> dict[str, Any]:
    """``{"commit": sha, "dirty": bool}`` of the checkout holding this package (nulls outside git)."""
    root = Path(__file__).resolve().parents[1]
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=10, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=root,
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return {"commit": None, "dirty": None}
    return {"commit": commit or None, "dirty": bool(dirty)}


def package_versions() -> dict[str, str | None]:
    """Python's and every :data:`RECORDED_DISTRIBUTIONS` version."""
    out: dict[str, str | None] = {"python": sys.version.split()[0]}
    for dist in RECORDED_DISTRIBUTIONS:
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = None
    return out


def hydra_job_info() -> dict[str, Any] | None:
    """The Hydra job's overrides, number and sweep directory (None outside a Hydra job)."""
    try:
        from hydra.core.hydra_config import HydraConfig
        from omegaconf import OmegaConf

        if not HydraConfig.initialized():
            return None
        hc: Any = HydraConfig.get()
        mode = str(getattr(hc.mode, "name", hc.mode))
        return {
            "mode": mode,
            "overrides": list(hc.overrides.task),
            "job_num": OmegaConf.select(hc, "job.num", default=None),
            "override_dirname": hc.job.override_dirname,
            "output_dir": hc.runtime.output_dir,
            "sweep_dir": hc.sweep.dir if mode == "MULTIRUN" else None,
            "launcher": hc.launcher.get("_target_"),
        }
    except (ImportError, ValueError, AttributeError):
        return None


def run_info(seeds: Mapping[str, Any], device: str | None = None) -> dict[str, Any]:
    """Provenance of a run: git commit, package versions, seeds, device and threads, command line."""
    import torch

    return {
        "git": git_commit(),
        "versions": package_versions(),
        "seeds": dict(seeds),
        "environment": {
            "device": device,
            "torch_threads": torch.get_num_threads(),
            "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
            "ray_gpu_ids": ray_gpu_ids(),
        },
        "argv": list(sys.argv),
        "hydra": hydra_job_info(),
    }


def write_run_files(out_dir: str | Path, config: Mapping[str, Any], info: Mapping[str, Any]) -> None:
    """Write ``config.yaml`` (the resolved config) and ``run_info.json`` into ``out_dir``."""
    from omegaconf import OmegaConf

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.yaml").write_text(OmegaConf.to_yaml(OmegaConf.create(dict(config))))
    (out / "run_info.json").write_text(json.dumps(info, indent=2, default=str) + "\n")


# ---------------------------------------------------------------------------------------- device
def ray_gpu_ids() -> list[int] | None:
    """The GPUs Ray granted the current task; None outside a Ray task (Ray not imported, not
    initialised, or this is the driver)."""
    if "ray" not in sys.modules:
        return None
    import ray

    if not ray.is_initialized():
        return None
    if ray.get_runtime_context().worker.mode != ray.WORKER_MODE:
        return None
    return [int(g) for g in ray.get_gpu_ids()]


def pick_device(requested: str | None) -> str:
    """The job's device: ``requested`` when set; in a Ray task ``cuda`` iff Ray granted GPUs (Ray then
    sets ``CUDA_VISIBLE_DEVICES`` to them, so ``cuda`` is the first granted one) else ``cpu``;
    elsewhere ``cuda`` when available, else ``cpu``."""
    if requested:
        return requested
    granted = ray_gpu_ids()
    if granted is not None:
        return "cuda" if granted else "cpu"
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


# --------------------------------------------------------------------------------------- tracking
class Tracker(Protocol):
    """Experiment tracking of one run (one job)."""

    def log(self, metrics: Mapping[str, Any], step: int | None = None) -> None:
        """Log per-step metrics."""

    def log_summary(self, metrics: Mapping[str, Any]) -> None:
        """Set summary metrics (nested mappings are flattened to ``a/b`` keys)."""

    def log_images(self, images: Mapping[str, str | Path]) -> None:
        """Log image files (PNG) under their names."""

    def log_table(self, name: str, columns: list[str], rows: list[list[Any]]) -> None:
        """Log a table."""

    def finish(self, exit_code: int = 0) -> None:
        """End the run (idempotent)."""


class NullTracker:
    """``logger=none``: does nothing and creates nothing."""

    def log(self, metrics: Mapping[str, Any], step: int | None = None) -> None:
        return None

    def log_summary(self, metrics: Mapping[str, Any]) -> None:
        return None

    def log_images(self, images: Mapping[str, str | Path]) -> None:
        return None

    def log_table(self, name: str, columns: list[str], rows: list[list[Any]]) -> None:
        return None

    def finish(self, exit_code: int = 0) -> None:
        return None


def flatten(metrics: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}, "c": [1, 2]}`` -> ``{"a/b": 1, "c": [1, 2]}``; None values are dropped."""
    out: dict[str, Any] = {}
    for key, value in metrics.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            out.update(flatten(value, f"{name}/"))
        elif value is not None:
            out[name] = value
    return out


class WandbTracker:
    """``logger=wandb``: one wandb run in ``<run dir>/wandb``, offline unless the config or
    ``$WANDB_MODE`` says otherwise. The job that starts it finishes it (also on failure)."""

    def __init__(
        self,
        cfg: WandbLoggerConfig,
        run_dir: str | Path,
        config: Mapping[str, Any],
        job_type: str = "experiment",
        name: str | None = None,
        group: str | None = None,
    ) -> None:
        import wandb

        run_dir = Path(run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        self._wandb = wandb
        self.mode = cfg.resolved_mode()
        self.run = wandb.init(
            project=cfg.project,
            entity=cfg.entity,
            group=cfg.group or group,
            name=cfg.run_name or name,
            tags=list(cfg.tags) or None,
            job_type=job_type,
            dir=str(run_dir),
            mode=self.mode,  # type: ignore[arg-type]
            config=dict(config),
            reinit="finish_previous",
            settings=wandb.Settings(silent=True),
        )
        self._finished = False

    @property
    def run_path(self) -> Path | None:
        """The run's local directory (``.../wandb/offline-run-...``)."""
        d = getattr(self.run, "dir", None)
        return Path(d).parent if d else None

    def log(self, metrics: Mapping[str, Any], step: int | None = None) -> None:
        self.run.log(flatten(metrics), step=step)

    def log_summary(self, metrics: Mapping[str, Any]) -> None:
        for key, value in flatten(metrics).items():
            self.run.summary[key] = value

    def log_images(self, images: Mapping[str, str | Path]) -> None:
        if images:
            self.run.log({name: self._wandb.Image(str(path)) for name, path in images.items()})

    def log_table(self, name: str, columns: list[str], rows: list[list[Any]]) -> None:
        cols: list[Any] = list(columns)
        self.run.log({name: self._wandb.Table(columns=cols, data=rows)})

    def finish(self, exit_code: int = 0) -> None:
        if not self._finished:
            self._finished = True
            self.run.finish(exit_code=exit_code)


def make_tracker(
    cfg: LoggerConfig,
    run_dir: str | Path,
    config: Mapping[str, Any],
    job_type: str = "experiment",
    name: str | None = None,
    group: str | None = None,
) -> Tracker:
    """The tracker of the ``logger`` option (a :class:`NullTracker` for ``logger=none``)."""
    if isinstance(cfg, WandbLoggerConfig):
        return WandbTracker(cfg, run_dir, config, job_type=job_type, name=name, group=group)
    return NullTracker()


def run_tracked(cfg: Any, run_dir: Path, job: Callable[[Tracker], T], job_type: str = "experiment") -> T:
    """Run ``job(tracker)`` inside the tracker of ``cfg.logger`` (config with git commit and package
    versions; in a multirun named by the job's overrides) and finish it, with exit code 1 on failure."""
    from experiments.config import config_to_dict

    name, group = hydra_run_names()
    tracker = make_tracker(
        cfg.logger,
        run_dir,
        {**config_to_dict(cfg), "git": git_commit(), "versions": package_versions()},
        job_type=job_type,
        name=name,
        group=group,
    )
    exit_code = 1
    try:
        result = job(tracker)
        exit_code = 0
    finally:
        tracker.finish(exit_code)
    return result


def hydra_run_names() -> tuple[str | None, str | None]:
    """``(name, group)`` of the wandb run of a Hydra job: in a multirun, the job's overrides and the
    sweep directory; (None, None) otherwise."""
    info = hydra_job_info()
    if info is None or info["mode"] != "MULTIRUN":
        return None, None
    name = info["override_dirname"] or f"job{info['job_num']}"
    return name, str(info["sweep_dir"])


# ------------------------------------------------------------------------------- offline runs
_WANDB_HEADER = 7  # ":W&B", magic 0xBEE1, version
_BLOCK = 32768  # LevelDB log format: 32 KiB blocks of records with 7-byte headers
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


def _wandb_records(path: Path) -> list[bytes]:
    data = path.read_bytes()
    if data[:4] != b":W&B":
        raise ValueError(f"{path} is not a wandb run file")
    records, payload, pos = [], b"", _WANDB_HEADER
    while pos + 7 <= len(data):
        left = _BLOCK - pos % _BLOCK
        if left < 7:
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if kind == 0 and length == 0:  # block padding
            pos += left
            continue
        payload += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (_FULL, _LAST):
            records.append(payload)
            payload = b""
    return records


def _item_key(item: Any) -> str:
    return "/".join(item.nested_key) if item.nested_key else item.key


def read_offline_run(run_dir: str | Path) -> dict[str, Any]:
    """Config, history rows and final summary of an offline wandb run directory
    (``.../wandb/offline-run-<time>-<id>``), read from its ``run-<id>.wandb`` file.

    Returns:
        ``{"run_id", "project", "config", "history", "summary", "finished"}``; ``history`` is the logged
        rows (``_step`` included), ``summary`` the last value of every summary key.
    """
    from wandb.proto import wandb_internal_pb2 as pb

    run_dir = Path(run_dir)
    files = sorted(run_dir.glob("run-*.wandb"))
    if not files:
        raise FileNotFoundError(f"no run-*.wandb file in {run_dir}")
    out: dict[str, Any] = {
        "run_id": None,
        "project": None,
        "config": {},
        "history": [],
        "summary": {},
        "finished": False,
    }
    for raw in _wandb_records(files[0]):
        rec = pb.Record()  # type: ignore[attr-defined]
        rec.ParseFromString(raw)
        kind = rec.WhichOneof("record_type")
        if kind == "run":
            out["run_id"], out["project"] = rec.run.run_id, rec.run.project
            for item in rec.run.config.update:
                out["config"][_item_key(item)] = json.loads(item.value_json)
        elif kind == "config":
            for item in rec.config.update:
                out["config"][_item_key(item)] = json.loads(item.value_json)
        elif kind == "history":
            out["history"].append({_item_key(i): json.loads(i.value_json) for i in rec.history.item})
        elif kind == "summary":
            for item in rec.summary.update:
                out["summary"][_item_key(item)] = json.loads(item.value_json)
        elif kind == "exit":
            out["finished"] = True
    return out


def offline_runs(root: str | Path) -> list[Path]:
    """Every offline wandb run directory under ``root``, sorted."""
    return sorted(p for p in Path(root).rglob("offline-run-*") if p.is_dir())
