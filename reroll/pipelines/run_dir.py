"""The run directory: opened (never over an earlier run), its metrics and resolved config written with
the first metrics, checkpoints committed whole, and the ``RunResult`` a finished run returns."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from reroll.config.loader import dump_config
from reroll.config.run import RunConfig
from reroll.data.coverage import lost_characters_warning
from reroll.errors import RoleError, UserError
from reroll.models.loading import load_tokenizer
from reroll.pipelines.pipeline import Checkpointed
from reroll.roles.critic import CriticGroup
from reroll.roles.trainer import TrainerGroup
from reroll.runtime import checkpoint, node_copies, storage
from reroll.runtime.console import shown
from reroll.runtime.metrics import MetricsLogger, MlflowSettings

log = logging.getLogger(__name__)


@dataclass
class RunResult:
    """Where a finished run put things, and its last metrics."""

    run_dir: Path
    checkpoint: Path | None
    metrics_path: Path
    config_path: Path
    final_metrics: dict[str, float] = field(default_factory=dict)
    storage: str | None = None  # checkpoint.storage, where the checkpoints are copied

    @property
    def model_path(self) -> Path | None:
        """The directory ``AutoModelForCausalLM.from_pretrained`` loads: ``model/`` in the checkpoint."""
        return self.checkpoint / "model" if self.checkpoint is not None else None

    def summary(self, name: str) -> str:
        """The lines a finished run prints: held-out accuracy and where everything is (relative to the
        working directory when below it)."""
        acc = self.final_metrics.get("eval/accuracy")
        lines = [f"done: {name}" + (f" | held-out accuracy {acc:.3f}" if acc is not None else "")]
        if self.checkpoint is not None:  # the loadable model first: that is what people copy
            lines.append(
                f"  model:      {shown(self.model_path)}  (from_pretrained loads it, tokenizer included)"
            )
            lines.append(
                f"  checkpoint: {shown(self.checkpoint)}  (model, optimizer, data position: --resume)"
            )
            if self.storage is not None:
                lines.append(
                    f"  copied to:  {self.storage}  (--resume downloads it where the run directory is gone)"
                )
        tb = self.run_dir / "tensorboard"
        lines.append(
            f"  metrics:    {shown(self.metrics_path)}"
            + (f"  (tensorboard --logdir {shown(tb)})" if tb.exists() else "")
        )
        lines.append(f"  config:     {shown(self.config_path)}")
        return "\n".join(lines)


def warn_unrepresentable(cfg: RunConfig, texts: Iterable[str]) -> None:
    """Say once, at start, which characters of the run's text the tokenizer cannot represent."""
    message = lost_characters_warning(load_tokenizer(cfg.model.path), texts)
    if message:
        log.warning("%s", message)


def open_run_dir(cfg: RunConfig, *, resume: bool) -> tuple[Path | None, Path]:
    """The run directory (made if new) and, on resume, the checkpoint to start from.

    Nothing in it is written here: the resolved config and the metrics are written with the first
    metrics (``open_metrics``), so a run that fails before then leaves an existing directory's files
    as they were. A new run (no ``--resume``) refuses a directory that holds an earlier run's files
    rather than overwrite them: the user picks a new name or deletes the old run."""
    run_dir = cfg.run_dir
    if (
        url := cfg.storage_url
    ) is not None:  # a copy of the run elsewhere: the newest checkpoint may be there
        _storage_call(
            url,
            "reading the run's copy from",
            lambda: storage.restore(url, run_dir, checkpoint.RECORDS, resume=resume),
        )
    found = checkpoint.latest(run_dir) if resume else None
    if resume and found is None:
        also = f" or in checkpoint.storage {cfg.storage_url}" if cfg.storage_url is not None else ""
        raise UserError(
            f"--resume: no complete checkpoint under {run_dir / 'checkpoints'}{also}; run without --resume"
        )
    if not resume and checkpoint.latest(run_dir) is not None:
        raise UserError(
            f"{run_dir} already holds checkpoints: add --resume to continue that run, or set name / "
            f"output_dir to start a new one (nothing was overwritten)"
        )
    earlier = [n for n in ("config.yaml", "metrics.jsonl") if (run_dir / n).exists()]
    if not resume and earlier:
        raise UserError(
            f"{run_dir} holds an earlier run ({', '.join(earlier)}) with no complete checkpoint to resume: "
            f"set name / output_dir to start a new run, or delete {run_dir} to replace it (nothing was "
            f"overwritten)"
        )
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UserError(
            f"output_dir: cannot make the run directory {run_dir} ({e.strerror}): choose another output_dir"
        ) from e
    return found, run_dir


def open_metrics(cfg: RunConfig, resume_step: int | None) -> MetricsLogger:
    """The run's metrics sinks, opened with the first metrics; the resolved config is written then too."""
    lg = cfg.logging
    return MetricsLogger(
        cfg.run_dir,
        tensorboard=lg.tensorboard,
        wandb=lg.wandb,
        wandb_project=lg.wandb_project,
        run_name=cfg.name,
        config=cfg.model_dump(mode="json"),
        resume_step=resume_step,
        on_open=lambda: dump_config(cfg, cfg.run_dir / "config.yaml"),
        mlflow=MlflowSettings(lg.mlflow_experiment, lg.mlflow_tracking_uri) if lg.mlflow else None,
    )


def save_checkpoint(
    cfg: RunConfig, actor: TrainerGroup, step: int, extra: Checkpointed, critic: CriticGroup | None = None
) -> Path:
    """A complete checkpoint of ``step`` (see ``reroll.runtime.checkpoint``), older ones pruned: the
    policy (``model/``, loadable by ``from_pretrained``, with the tokenizer), its optimizer, the critic
    (``critic/``) if any, and the pipeline's own state. A write that fails removes the partial
    checkpoint; an ``OSError`` (a full disk) becomes one ``UserError`` naming the newest complete one."""
    partial = checkpoint.begin(cfg.run_dir, step)
    url, name = cfg.storage_url, checkpoint.step_name(step)
    try:
        if url is not None:
            _storage_call(
                url, f"removing an earlier copy of {name} from", lambda: storage.Storage(url).begin(step)
            )
        actor.save(partial, with_optimizer=True)
        if critic is not None:
            critic.save(partial)
        if node_copies.spread(url):  # ranks on nodes whose disks are their own wrote their parts there
            node_copies.gather(url, partial, f"checkpoints/{name}", drop=True)
        for key, obj in extra.objects.items():
            torch.save(obj, partial / key)
        load_tokenizer(cfg.model.path).save_pretrained(partial / "model")
        final = checkpoint.commit(partial, {"step": step, **extra.state})
    except BaseException as e:  # a full disk, a dead worker: no partial checkpoint stays behind
        checkpoint.discard(partial)
        if not isinstance(e, UserError) and (os_error := _os_error(e)) is not None:
            who = str(e).partition(" failed during")[0] if isinstance(e, RoleError) else "the controller"
            raise checkpoint.write_failed(cfg.run_dir, step, os_error, who) from e
        raise
    checkpoint.prune(cfg.run_dir, cfg.checkpoint.keep_last)
    if url is not None:
        seconds = _storage_call(
            url,
            f"copying {name} to",
            lambda: storage.Storage(url).finish(final, cfg.checkpoint.keep_last),
            kept=final,
        )
        log.info("checkpoint %s copied to %s in %.1f s", name, url, seconds)
    return final


def _storage_call(url: str, what: str, call: Callable[[], Any], kept: Path | None = None) -> Any:
    """``call()``, its failure (a network error, expired credentials, a full bucket) one ``UserError``:
    the run stops, and the local checkpoint ``kept`` (complete) is named for --resume."""
    try:
        return call()
    except UserError:
        raise
    except Exception as e:
        local = f" The local checkpoint {kept} is complete." if kept is not None else ""
        raise UserError(
            f"checkpoint.storage: {what} {url} failed ({type(e).__name__}: {e}).{local} Fix the storage "
            f"(credentials, space, the network) and continue with --resume, or unset checkpoint.storage"
        ) from e


def copy_records(cfg: RunConfig, metrics: MetricsLogger) -> None:
    """Copy the run's ``checkpoint.RECORDS`` to its storage, after a step that checkpointed has logged its
    metrics: a run resumed from that checkpoint finds its reference and keeps its history. A copy that
    fails stops the run as a checkpoint's does (a resume elsewhere would lack the reference)."""
    if (url := cfg.storage_url) is None:
        return
    metrics.flush()
    _storage_call(
        url,
        "copying the run's records to",
        lambda: storage.Storage(url).upload_records(cfg.run_dir, checkpoint.RECORDS),
    )


def _os_error(e: BaseException | None) -> OSError | None:
    """The ``OSError`` behind ``e`` (a worker's, behind its ``RoleError``), if that is what it was."""
    for _ in range(8):
        inner = getattr(e, "cause", None)  # a RayTaskError's cause; a RoleError's is a string
        if isinstance(inner, BaseException):
            e = inner
        elif e is None or isinstance(e, OSError):
            return e
        else:
            e = e.__cause__
    return None
