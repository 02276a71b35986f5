"""The run skeleton every pipeline shares, and the roles of a run with the phases that own their devices.

A pipeline (rlvr, agentic, sft, ...) is a ``Pipeline``: it loads its data, says which roles it needs,
and supplies one step, its evaluation and the state it checkpoints. ``run`` owns the rest, once for
all of them: the run directory and resolved config, resume or warm start, the reference snapshot,
the first weight sync, the step loop with every-N evaluation and checkpoints, the metrics and the
one line per step, failures named with their step, and the ``RunResult``.

Every call into a role happens inside ``roles.phase(name, *roles_used)``: the phase makes the roles
it names resident on their devices (offloading colocated others first), times itself as
``timing/<name>``, and names itself in a failing role's error. A call into a role that is offloaded
is refused (``WorkerGroup.handles``), so a phase that forgets a role fails loudly instead of running
a model off its device.
"""

from __future__ import annotations

import copy
import logging
import math
import tempfile
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import torch
from tqdm import tqdm

from reroll.config.loader import dump_config
from reroll.config.placement import (
    colocated_engines,
    engine_headroom,
    engine_may_stay,
    offload_between_phases,
    weight_sync_transport,
)
from reroll.config.schema import RunConfig
from reroll.data.coverage import lost_characters_warning
from reroll.errors import RewardFailure, RoleError, UserError
from reroll.models.loading import load_tokenizer
from reroll.models.tiny import ensure_tiny_model
from reroll.pipelines.preflight import preflight
from reroll.roles.critic import CriticGroup
from reroll.roles.env import EnvGroup
from reroll.roles.reward import RewardGroup
from reroll.roles.reward_model import RewardModelGroup
from reroll.roles.rollout import RolloutGroup, form_weight_group
from reroll.roles.teacher import TeacherSet
from reroll.roles.trainer import TrainerGroup
from reroll.runtime import checkpoint, stacks
from reroll.runtime.actors import WorkerGroup, start_ray
from reroll.runtime.console import step_line
from reroll.runtime.metrics import MetricsLogger, MlflowSettings
from reroll.runtime.placement import Colocation, ResourceManager
from reroll.runtime.timing import PhaseTimer

log = logging.getLogger(__name__)


@dataclass
class RunResult:
    """Where a finished run put things, and its last metrics."""

    run_dir: Path
    checkpoint: Path | None
    metrics_path: Path
    config_path: Path
    final_metrics: dict[str, float] = field(default_factory=dict)

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
                f"  model:      {_shown(self.model_path)}  (from_pretrained loads it, tokenizer included)"
            )
            lines.append(
                f"  checkpoint: {_shown(self.checkpoint)}  (model, optimizer, data position: --resume)"
            )
        tb = self.run_dir / "tensorboard"
        lines.append(
            f"  metrics:    {_shown(self.metrics_path)}"
            + (f"  (tensorboard --logdir {_shown(tb)})" if tb.exists() else "")
        )
        lines.append(f"  config:     {_shown(self.config_path)}")
        return "\n".join(lines)


def _shown(path: Path) -> Path:
    """``path`` relative to the working directory when below it, else as it is."""
    try:
        return path.relative_to(Path.cwd())
    except ValueError:
        return path


ENGINE_AWAKE_OOM = (
    "The vLLM engine was awake beside the trainers: placement.offload 'auto' keeps it awake where the "
    "worst trainer phase (one trainer's measured peak, scaled to responses of rollout.max_new_tokens, "
    "beside the others' state; every trainer's peak where nothing moves) fits beside its share of the "
    "GPU, and this step needed more. Give the trainers room: lower rollout.vllm.gpu_memory_utilization "
    "or optim.micro_batch_size / optim.logprob_micro_batch_size (or set placement.offload: always), then "
    "continue with `reroll train CONFIG --resume`."
)


def _share_hint(share: float, engine: int, resident: int, total: int, engines: int = 1) -> str:
    """What a run whose engine sleeps beside the measured trainers could do about it: the engine's
    shares (``rollout.vllm.gpu_memory_utilization``) at which it would stay awake, and at which nothing
    would move (``engine`` and ``resident``: bytes to spare at ``share``, negative; ``engines`` on the
    GPU, each taking ``share``)."""
    # the shares where the headroom reaches 0 (it falls by the GPU's bytes per unit of share and
    # engine), shown rounded down
    awake, still = (
        math.floor((share + spare / (engines * total)) * 100 + 1e-6) / 100 for spare in (engine, resident)
    )
    who = "the vLLM engine sleeps" if engines == 1 else f"the {engines} vLLM engines on the GPU sleep"
    each = "its share" if engines == 1 else "their shares"
    line = (
        f"placement: {who} through the trainers' phases (a sleep, a wake and a slower weight sync each "
        f"step): beside {each} (rollout.vllm.gpu_memory_utilization {share:g} = {share * total / 2**30:.1f} "
        f"GiB{' each' if engines > 1 else ''}) the worst trainer phase, as measured, is "
        f"{-engine / 2**30:.1f} GiB short of 90 % of the GPU."
    )
    if awake < 0.05:
        return line + " The trainers alone leave the engine no room to stay awake on this GPU."
    nothing = f", and nothing would move at {still:.2f} or less" if still >= 0.05 else ""
    return (
        f"{line} It would stay awake at a share of {awake:.2f} or less{nothing}, if the engine still fits in "
        "it (engine/kv_cache_usage says how much of its KV cache a step used)."
    )


@dataclass(frozen=True)
class RoleSet:
    """Which roles a run starts. actor_train runs except where nothing trains (``reroll generate``: the
    engine loads ``model.path`` itself); actor_infer except where nothing generates (preference
    pipelines without a held-out generation)."""

    actor_train: bool = True
    rollout: bool = True  # actor_infer: generation (and the held-out evaluation of most pipelines)
    reference: bool = False
    critic: bool = False
    reward: bool = True
    env: bool = False
    teacher: bool = False
    reward_model: bool = False


@dataclass
class Roles:
    """The role groups of a run, where ``placement`` put them, and the phases that take turns on devices."""

    cfg: RunConfig
    actor: TrainerGroup | None
    rollout: RolloutGroup | None = None
    reward: RewardGroup | None = None
    reference: TrainerGroup | None = None
    critic: CriticGroup | None = None
    env: EnvGroup | None = None
    teacher: TeacherSet | None = None
    reward_model: RewardModelGroup | None = None
    placement: ResourceManager | None = None
    colocation: Colocation | None = None
    timer: PhaseTimer = field(default_factory=PhaseTimer)
    current_phase: str | None = None
    restarted: list[str] = field(default_factory=list)  # '<role> at step <n>', one per restart
    sync_stats: dict[str, float] = field(default_factory=dict)  # the last weight sync's rate, until popped
    weight_group_formed: bool = False  # the 'collective' transport's group (formed again after restarts)
    engine_headroom_gb: float | None = None  # GPU memory to spare beside the awake engine (``_staying``)
    resident_headroom_gb: float | None = None  # the same with nothing moved at all
    share_hint_shown: bool = False  # ``_share_hint`` is printed once a run

    @classmethod
    def start(cls, cfg: RunConfig, needs: RoleSet) -> Roles:
        """Start the roles ``needs`` names where ``placement`` puts them; a role that fails to start
        stops the ones already started."""
        if cfg.runtime.backend == "ray":
            start_ray(cfg.runtime.ray_address)
        stacks.configure(cfg.run_dir)  # where a call past its bound writes every worker's stack
        placement = ResourceManager(cfg)
        cfg = placement.cfg  # device type resolved, for the workers
        started: dict[str, Any] = {}
        try:
            started["actor"] = TrainerGroup("actor_train", cfg, trainable=True) if needs.actor_train else None
            if needs.rollout:
                started["rollout"] = RolloutGroup(cfg)
            if needs.reward:
                started["reward"] = RewardGroup(cfg)
            if needs.reference:
                started["reference"] = TrainerGroup("reference", cfg, trainable=False)
            if needs.critic:
                started["critic"] = CriticGroup(cfg)
            if needs.env:
                started["env"] = EnvGroup(cfg)
            if needs.teacher:
                started["teacher"] = TeacherSet(cfg)
            if needs.reward_model:
                started["reward_model"] = RewardModelGroup(cfg)
        except BaseException:
            for group in started.values():
                if group is not None:
                    group.shutdown()
            placement.shutdown()
            raise
        roles = cls(cfg, **started, placement=placement)
        models = (
            roles.actor,
            roles.rollout,
            roles.reference,
            roles.critic,
            roles.teacher,
            roles.reward_model,
        )
        placed = {g.role: g for g in models if g}
        offload = offload_between_phases(cfg, placement.device_type)
        roles.colocation = Colocation(placed, placement.map, offload)
        if roles.colocation.enabled:
            for group in placed.values():
                group.residency_check = roles._check_resident
            if "actor_infer" in placed and engine_may_stay(cfg, placement.device_type):
                roles.colocation.let_stay(roles._staying)
        return roles

    def _staying(self) -> set[str]:
        """The roles left resident at an eviction, beside the vLLM engine's share of the GPU, from the
        colocated trainers' measured memory (``memory_need``: a role's peak scaled to the longest
        responses, its state between phases), remade at every eviction (the first step measures, with
        everything moving): every role where all the trainers' peaks fit beside the engine at once
        (nothing moves, no allocator cache is freed; ``placement/resident_headroom_gb``); else the engine
        alone where the worst trainer phase (one role's peak beside the others' state) fits beside it
        (no sleep, no wake, a weight sync into an awake engine; ``placement/engine_headroom_gb``); else
        none (``engine_headroom``)."""
        assert self.colocation is not None and self.colocation.map is not None
        needs, trainers, total = [], [], 0
        for name, group in self.colocation.groups.items():
            if name != "actor_infer" and self.colocation.map.colocated(name, "actor_infer"):
                if not hasattr(group, "memory_need"):
                    return set()  # a role that cannot say what it needs: the engine sleeps
                peak, rest, total = group.memory_need()
                needs.append((peak, rest))
                trainers.append(name)
        share = self.cfg.rollout.vllm.gpu_memory_utilization
        engines = max((colocated_engines(self.cfg, name) for name in trainers), default=1)
        engine = engine_headroom(needs, share, total, engines=engines)
        resident = engine_headroom(needs, share, total, resident=True, engines=engines)
        self.engine_headroom_gb = None if engine is None else engine / 2**30
        self.resident_headroom_gb = None if resident is None else resident / 2**30
        if resident is not None and resident >= 0:
            return {"actor_infer", *trainers}
        if engine is not None and engine >= 0:
            return {"actor_infer"}
        if engine is not None and not self.share_hint_shown:
            self.share_hint_shown = True
            tqdm.write(_share_hint(share, engine, resident or 0, total, engines))
        return set()

    @contextmanager
    def phase(self, name: str, *uses: str) -> Iterator[None]:
        """A named, timed phase whose roles ``uses`` hold their devices (colocated others are offloaded
        first; that move is timed as ``timing/offload`` / ``timing/reload``, not as this phase). A role
        failing inside raises its ``RoleError`` naming this phase."""
        self.hold(*uses)
        outer, self.current_phase = self.current_phase, name
        try:
            with self.timer(name):
                yield
        except RoleError as e:
            raise self._explained(e).in_phase(name) from e
        finally:
            self.current_phase = outer

    def _explained(self, e: RoleError) -> RoleError:
        """A role out of GPU memory while the engine stayed awake beside it says so, and the fix."""
        awake = self.colocation is not None and self.colocation.stayed.get("actor_infer", False)
        if not awake or "OutOfMemoryError" not in e.cause:
            return e
        return e.with_phase(e.phase, f"{e.cause}\n{ENGINE_AWAKE_OOM}")

    def hold(self, *uses: str) -> None:
        """Inside a phase: make ``uses`` resident for what follows (a phase that hands data from one
        colocated role to another, like a weight sync)."""
        if self.colocation is not None:
            self.colocation.use(*uses)

    def _check_resident(self, role: str) -> None:
        assert self.colocation is not None
        if role in self.colocation.offloaded:
            phase = self.current_phase or "(outside any phase)"
            raise RuntimeError(
                f"{role} was called in phase {phase!r} while offloaded (another role holds its device): "
                f"name it in the phase, `with roles.phase({phase!r}, {role!r}, ...)`"
            )

    def sync_weights(self) -> float:
        """actor_train's weights into actor_infer (gathered while the trainer holds its device), or only
        the LoRA adapters where ``strategy.lora.sync`` is 'adapters'. Returns the bytes sent
        (``sync/bytes``); its rate (``sync/gb_per_s``: bytes over the seconds of the whole sync, which
        ``timing/weight_sync`` shows) and, with the ``collective`` transport, the bytes that went
        through the group (``sync/bytes_collective``) come with the next ``pop_timings``."""
        assert self.rollout is not None, "sync_weights: this run has no actor_infer"
        lora = self.cfg.strategy.lora
        began = time.perf_counter()
        stats: dict[str, float] = {}
        with self.phase("weight_sync", "actor_train"):
            if lora is not None and lora.sync == "adapters":  # small: through the object store
                update = self.actor.adapter_update()
                sent = self.actor.sync_bytes()
                self.hold("actor_infer")
                self.rollout.update_lora(update.tensors, update.config)
            else:
                transport = weight_sync_transport(self.cfg, self.cfg.placement.device_type)
                if transport == "collective":
                    sent, stats = self._broadcast_weights()
                else:
                    buckets = self.actor.weight_buckets(self.cfg.rollout.weight_sync_bucket_mb, transport)
                    sent = self.actor.sync_bytes()  # runs once the buckets are made
                    self.hold("actor_infer")
                    self.rollout.load_weight_buckets(buckets)
                if transport == "cuda_ipc":
                    self.actor.release_shared()
            self.rollout.weights_version = self.actor.weights_version
        seconds = time.perf_counter() - began
        self.sync_stats = stats | {"sync/gb_per_s": sent / seconds / 1e9}
        return float(sent)

    def _broadcast_weights(self) -> tuple[int, dict[str, float]]:
        """The ``collective`` transport: both roles resident (placement keeps them apart), the group
        formed if this is the first sync since either role (re)started, then each bucket broadcast
        as it is gathered. A failure leaves the group to be formed again at the next sync."""
        assert self.actor is not None and self.rollout is not None
        self.hold("actor_train", "actor_infer")
        try:
            if not self.weight_group_formed:
                backend = "nccl" if self.cfg.placement.device_type == "cuda" else "gloo"
                form_weight_group(self.actor, self.rollout, backend)
                self.weight_group_formed = True
            buckets = self.actor.weight_buckets(self.cfg.rollout.weight_sync_bucket_mb, "collective")
            self.rollout.load_weight_buckets(buckets)
        except RoleError:
            self.weight_group_formed = False
            raise
        return self.actor.sync_bytes(), {"sync/bytes_collective": float(self.actor.collective_bytes())}

    def sync_if_stale(self) -> dict[str, float]:
        """Sync the engine if actor_train has stepped or loaded since: ``{"sync/bytes": ...}`` or ``{}``."""
        if self.actor is None or self.rollout is None:
            return {}
        if self.rollout.weights_version == self.actor.weights_version:
            return {}
        return {"sync/bytes": self.sync_weights()}

    def restart(self, role: str) -> None:
        """A fresh worker group for ``role`` (one of its workers died), resident on its devices. What it
        held comes back where this can give it: an engine gets actor_train's current weights, the
        reference its snapshot; judge restarts the reward workers too (they hold its handles).
        actor_train and critic come back as built: ``_recover`` loads their checkpoint."""
        groups: dict[str, WorkerGroup | TeacherSet | None] = {
            "actor_train": self.actor,
            "actor_infer": self.rollout,
            "reward": self.reward,
            "judge": self.reward,
            "reference": self.reference,
            "critic": self.critic,
            "env": self.env,
            "teacher": self.teacher,
            "reward_model": self.reward_model,
        }
        group = groups.get(role)
        if group is None:
            raise ValueError(f"no role {role!r} in this run to restart")
        if self.colocation is not None:  # colocated others leave the device before the new workers load
            self.colocation.offloaded.discard(group.role)
            self.colocation.use(group.role)
        if group is self.actor or group is self.rollout:
            self.weight_group_formed = False  # a new member: the next sync forms the group again
        if role == "judge":
            self.reward.restart(judge=True)  # type: ignore[union-attr]
        else:
            group.restart()
        if group is self.actor:
            self.actor.weights_version += 1  # back to model.path's weights: the engine's are stale
        elif group is self.rollout:
            self.sync_weights()
        elif group is self.reference:
            with self.phase("recover", "reference"):
                self.reference.load(self.cfg.run_dir / "reference")

    @contextmanager
    def profiled(self, step: int) -> Iterator[None]:
        """With ``step`` in ``logging.profile_steps``: torch.profiler in every trainer rank for the
        step's work, written under ``<run dir>/profile`` when the step ends (a step that fails writes
        nothing)."""
        groups = [g for g in (self.actor, self.reference, self.critic) if g is not None]
        if step not in self.cfg.logging.profile_steps or not groups:
            yield
            return
        for group in groups:
            group.profile_start(step)
        yield
        directory = self.cfg.run_dir / "profile"
        written = [path for group in groups for path in group.profile_stop(directory)]
        tqdm.write(f"profile of step {step}: {len(written)} files in {_shown(directory)}")

    def pop_timings(self) -> dict[str, float]:
        """``timing/<phase>`` since the last call, with the colocation moves, and the last weight
        sync's ``sync/gb_per_s`` (and ``sync/bytes_collective``) if one ran since, the bytes the moves
        carried (``offload/bytes``, ``reload/bytes`` and their GB/s), and whether the engine and the
        other roles stayed resident (``placement/<role>_stayed``, ``placement/*_headroom_gb``)."""
        placement: dict[str, float] = {}
        if self.colocation is not None:
            self.timer.add(self.colocation.pop_seconds())
            placement = self.colocation.metrics() | self.colocation.pop_moves()
        for name in ("engine_headroom_gb", "resident_headroom_gb"):
            if getattr(self, name) is not None:
                placement[f"placement/{name}"] = getattr(self, name)
        stats, self.sync_stats = self.sync_stats, {}
        return self.timer.pop() | stats | placement

    def shutdown(self) -> None:
        groups = (self.env, self.actor, self.rollout, self.reward, self.reference, self.critic, self.teacher)
        for group in (*groups, self.reward_model):
            if group is not None:
                group.shutdown()
        if self.placement is not None:
            self.placement.shutdown()


@dataclass
class Checkpointed:
    """What a pipeline saves beside the model: JSON state (``trainer_state.json``) and torch objects
    saved under their file names."""

    state: dict[str, Any] = field(default_factory=dict)
    objects: dict[str, Any] = field(default_factory=dict)


class Pipeline:
    """One pipeline's part of a run. ``__init__`` loads the data (before any role starts, so bad input
    costs nothing); ``run`` then starts ``roles_needed()`` and calls the rest."""

    name: ClassVar[str]
    evaluate_uses: ClassVar[tuple[str, ...]] = ("actor_infer",)  # the roles ``evaluate`` calls

    def __init__(self, cfg: RunConfig) -> None:
        self.cfg = cfg

    @property
    def total_steps(self) -> int:
        return self.cfg.total_steps

    def roles_needed(self) -> RoleSet:
        return RoleSet()

    def texts(self) -> Iterable[str]:
        """The text the model will read and write (prompts, targets), checked at start for characters
        the tokenizer cannot represent."""
        return ()

    def optimizer(self) -> tuple[float, int]:
        """actor_train's learning rate and warm-up steps for the loop."""
        return self.cfg.optim.lr, self.cfg.optim.warmup_steps

    def warm_start(self, roles: Roles) -> None:
        """A fresh run's preparation before step 1 (an SFT warm start); nothing by default."""

    def restore(self, saved: dict[str, Any], directory: Path) -> None:
        """Resume the pipeline's own state from a checkpoint (the models are loaded already)."""

    def checkpointed(self) -> Checkpointed:
        return Checkpointed()

    def snapshot(self) -> Checkpointed:
        """The state ``checkpointed`` saves, copied in memory: a step retried after a worker died
        ``rewind``s to it and draws the same prompts, so every sample is counted once."""
        return copy.deepcopy(self.checkpointed())

    def rewind(self, saved: Checkpointed) -> None:
        """Back to a ``snapshot``, through ``restore`` (the path a resumed run takes)."""
        with tempfile.TemporaryDirectory(prefix="reroll-rewind-") as tmp:
            for name, obj in saved.objects.items():
                torch.save(obj, Path(tmp) / name)
            self.restore(saved.state, Path(tmp))

    def step(self, roles: Roles, step: int) -> dict[str, float]:
        raise NotImplementedError

    def evaluate(self, roles: Roles) -> dict[str, float]:
        """Held-out metrics (``eval/accuracy`` first of all), run inside the ``evaluate`` phase."""
        return {}

    def sample_line(self) -> str | None:
        """A line showing one of the last step's samples, as the model saw it."""
        return None


def every(n: int, step: int, total: int) -> bool:
    """Whether an every-``n``-steps duty falls on ``step``: every ``n``-th step (none with n=0) and
    always the last, so a finished run is evaluated and checkpointed."""
    return (n > 0 and step % n == 0) or step == total


def run(pipeline_cls: type[Pipeline], cfg: RunConfig, *, resume: bool = False) -> RunResult:
    """Run the pipeline for its ``total_steps`` (or continue the run in its directory)."""
    preflight(cfg)  # what `reroll validate` checks, before anything is built or started
    ensure_tiny_model(cfg.model)
    cfg = cfg.absolute_paths()  # workers on other nodes (or started elsewhere) read the driver's paths
    pipeline = pipeline_cls(cfg)
    late = [s for s in cfg.logging.profile_steps if s > pipeline.total_steps]
    if late:
        raise UserError(
            f"logging.profile_steps: {late} past the run's last step ({pipeline.total_steps}); "
            f"name steps from 1 to {pipeline.total_steps} (a warm one, not the first)"
        )
    warn_unrepresentable(cfg, pipeline.texts())
    resume_from, run_dir = open_run_dir(cfg, resume=resume)
    roles = Roles.start(cfg, pipeline.roles_needed())
    step, ckpt, last, total = 0, resume_from, {}, pipeline.total_steps
    try:
        start = _begin(pipeline, roles, resume_from)
        # roles.cfg: the config with the device type and strategy.name resolved, as config.yaml records it
        metrics_log = open_metrics(roles.cfg, resume_step=start if resume_from else None)
        if start == 0:
            with roles.phase("evaluate", *pipeline.evaluate_uses):
                before = pipeline.evaluate(roles)
            roles.pop_timings()
            metrics_log.log(0, before)
            tqdm.write(step_line(0, total, before))
        initial, step = pipeline.snapshot(), start + 1  # initial: where a trainer with no checkpoint restarts
        bar = tqdm(desc=pipeline.name, initial=start, total=total, disable=None)
        while step <= total:
            began, before, version = time.perf_counter(), pipeline.snapshot(), roles.actor.weights_version
            try:
                with roles.profiled(step):
                    metrics, ckpt = _step(pipeline, roles, step, ckpt)
            except RoleError as e:  # a dead worker: restarted and the step retried, or raised
                trained = roles.actor.weights_version != version
                step = _recover(e, step, pipeline, roles, (before, initial), trained=trained) + 1
                metrics_log.rewind(step - 1)
                bar.n = step - 1
                bar.refresh()
                continue
            if roles.restarted:
                metrics["recovery/restarts"] = len(roles.restarted)
            metrics |= roles.pop_timings() | {"timing/step": time.perf_counter() - began}
            metrics_log.log(step, metrics)
            last = metrics
            tqdm.write(step_line(step, total, metrics))
            line = pipeline.sample_line()
            if line and cfg.logging.sample_every and step % cfg.logging.sample_every == 0:
                tqdm.write(line)
            bar.update(1)
            step += 1
        bar.close()
        metrics_log.close()
    except (RoleError, RewardFailure) as e:
        raise (e.at_step(step) if step else e) from e
    finally:
        roles.shutdown()
    return RunResult(run_dir, ckpt, run_dir / "metrics.jsonl", run_dir / "config.yaml", last)


def _step(
    pipeline: Pipeline, roles: Roles, step: int, ckpt: Path | None
) -> tuple[dict[str, float], Path | None]:
    """One step, with its every-N evaluation and checkpoint: its metrics and the newest checkpoint."""
    cfg, total = pipeline.cfg, pipeline.total_steps
    metrics = pipeline.step(roles, step)
    if every(cfg.eval.every, step, total):
        metrics |= roles.sync_if_stale()
        with roles.phase("evaluate", *pipeline.evaluate_uses):
            metrics |= pipeline.evaluate(roles)
    if every(cfg.checkpoint.every, step, total):
        with roles.phase("checkpoint", "actor_train", "critic"):
            ckpt = save_checkpoint(cfg, roles.actor, step, pipeline.checkpointed(), roles.critic)
    return metrics, ckpt


def _recover(
    e: RoleError,
    step: int,
    pipeline: Pipeline,
    roles: Roles,
    snapshots: tuple[Checkpointed, Checkpointed],
    *,
    trained: bool,
) -> int:
    """Restart the role whose worker died during ``step`` (``e.died``; any other error is raised) and
    return the step the loop continues after.

    ``snapshots``: the pipeline's state before ``step`` and at the start of the loop. Most roles hold
    nothing the run cannot give back (``Roles.restart``): the pipeline rewinds to the first and the step is retried with the same prompts. actor_train and critic lose their weights
    and optimizer: both go back to the latest complete checkpoint, as ``--resume`` would (before the
    first, to the start of the run, warm start included), and the steps since are redone. So does
    any death after actor_train ``trained`` on ``step`` (in the weight sync or the evaluation): retrying
    the step would train on its samples twice. A worker that dies during the
    recovery is recovered in turn; ``runtime.max_restarts`` bounds them all."""
    cfg, limit = pipeline.cfg, pipeline.cfg.runtime.max_restarts
    (before, initial), back_to_checkpoint = snapshots, trained
    while True:
        if not e.died:
            raise e
        if len(roles.restarted) >= limit:
            used = f" ({', '.join(roles.restarted)})" if roles.restarted else ""
            raise e.with_phase(
                e.phase,
                f"{e.cause}; not restarted: runtime.max_restarts={limit} restarts were used{used}. Raise "
                f"runtime.max_restarts, or find why workers die in their logs (/tmp/ray/session_latest/logs)",
            )
        roles.restarted.append(f"{e.role} at step {step}")
        log.warning("step %d: %s; restarting %s (%d of %d)", step, e, e.role, len(roles.restarted), limit)
        roles.pop_timings()  # the failed attempt's
        try:
            if e.role in ("actor_train", "critic"):
                back_to_checkpoint = True
                roles.restart("actor_train")
                if roles.critic is not None:
                    roles.restart("critic")
            else:
                roles.restart(e.role)
            if not back_to_checkpoint:
                pipeline.rewind(before)
                return step - 1
            found = checkpoint.latest(cfg.run_dir)
            if found is None:
                pipeline.rewind(initial)
            log.warning("step %d: the run continues from %s", step, found or "its start")
            return _begin(pipeline, roles, found)
        except RoleError as again:
            e = again


def _begin(pipeline: Pipeline, roles: Roles, resume_from: Path | None) -> int:
    """Resume from a checkpoint, or warm-start; then snapshot the reference and sync the engine.

    Returns the step the loop continues after."""
    cfg, start = pipeline.cfg, 0
    with roles.phase("start", "actor_train", "critic"):
        roles.actor.configure_optimizer(*pipeline.optimizer())
        if resume_from is not None:
            roles.actor.load(resume_from)
            if roles.critic is not None:
                roles.critic.load(resume_from)
            saved = checkpoint.read_state(resume_from)
            pipeline.restore(saved, resume_from)
            start = saved["step"]
            log.info("resumed from %s (step %d)", resume_from, start)
    if resume_from is None:
        pipeline.warm_start(roles)
    if roles.reference is not None:  # the reference is the policy the loop starts from (after any warm start)
        ref_dir = cfg.run_dir / "reference"
        if resume_from is None:
            with roles.phase("start", "actor_train"):
                roles.actor.save(ref_dir, with_optimizer=False)
        with roles.phase("start", "reference"):
            roles.reference.load(ref_dir)
    roles.sync_if_stale()
    roles.pop_timings()
    return start


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
    found = checkpoint.latest(run_dir) if resume else None
    if resume and found is None:
        raise UserError(
            f"--resume: no complete checkpoint under {run_dir / 'checkpoints'}; run without --resume"
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
    try:
        actor.save(partial, with_optimizer=True)
        if critic is not None:
            critic.save(partial)
        for name, obj in extra.objects.items():
            torch.save(obj, partial / name)
        load_tokenizer(cfg.model.path).save_pretrained(partial / "model")
        final = checkpoint.commit(partial, {"step": step, **extra.state})
    except BaseException as e:  # a full disk, a dead worker: no partial checkpoint stays behind
        checkpoint.discard(partial)
        if (os_error := _os_error(e)) is not None:
            who = str(e).partition(" failed during")[0] if isinstance(e, RoleError) else "the controller"
            raise checkpoint.write_failed(cfg.run_dir, step, os_error, who) from e
        raise
    checkpoint.prune(cfg.run_dir, cfg.checkpoint.keep_last)
    return final


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
