"""The roles of a run: their worker groups, where placement put them, and the phases that take turns
on devices.

``Roles.start(cfg)`` starts every role ``reroll.config.placement.run_roles`` names (the registry that
``reroll plan`` and ``reroll validate`` read too) and holds them in one mapping, ``roles.groups``, with a
typed accessor per role (``roles.actor_train``, ``roles.actor_infer``, ...). Every call into a role
happens inside ``roles.phase(name, *roles_used)``: the phase makes the roles it names resident on their
devices (offloading colocated others first), times itself as ``timing/<name>``, and names itself in a
failing role's error. A call into a role that is offloaded is refused (``WorkerGroup.handles``).

Weight freshness is kept here: ``sync_if_stale`` brings actor_infer to actor_train's version (the run
calls it before every step and every evaluation), and actor_infer refuses to generate on stale weights
unless told otherwise (``EngineGroup.check_fresh``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from typing import Any

from tqdm import tqdm

from reroll.config.engines import engine_spec
from reroll.config.placement import (
    RoleSpec,
    engine_may_stay,
    ipc_senders,
    offload_between_phases,
    run_roles,
    weight_sync_transport,
)
from reroll.config.role_memory import USABLE
from reroll.config.run import RunConfig
from reroll.errors import RoleError
from reroll.pipelines.preflight_nodes import check_nodes
from reroll.pipelines.residency import ENGINE_AWAKE_OOM, colocated_needs, staying
from reroll.roles.actor_infer import EngineGroup, form_weight_group
from reroll.roles.critic import CriticGroup
from reroll.roles.env import EnvGroup
from reroll.roles.learned_reward import LearnedRewardGroup
from reroll.roles.reward import RewardGroup
from reroll.roles.teacher import TeacherSet
from reroll.roles.trainer import TrainerGroup
from reroll.runtime import checkpoint, node_copies, stacks
from reroll.runtime.actors import start_ray
from reroll.runtime.console import shown
from reroll.runtime.placement import Colocation, ResourceManager
from reroll.runtime.timing import PhaseTimer

# How each role's group is built. judge has none of its own: the reward workers start it and hold its
# handles (reroll.roles.reward); tests check that this covers reroll.config.roles.ROLES.
GROUPS: dict[str, Callable[[RunConfig], Any] | None] = {
    "actor_train": lambda cfg: TrainerGroup("actor_train", cfg, trainable=True),
    "actor_infer": EngineGroup,
    "reference": lambda cfg: TrainerGroup("reference", cfg, trainable=False),
    "critic": CriticGroup,
    "reward": RewardGroup,
    "judge": None,
    "env": EnvGroup,
    "teacher": TeacherSet,
    "learned_reward": LearnedRewardGroup,
}
SHUTDOWN_FIRST = ("env",)  # env workers may hold calls into the engine (agent episodes)


@dataclass
class Roles:
    """The role groups of a run (``groups``, by role name, in ``run_roles`` order), the specs they were
    started from, where ``placement`` put them, and the phases that take turns on devices."""

    cfg: RunConfig
    groups: dict[str, Any]
    specs: dict[str, RoleSpec] = field(default_factory=dict)
    placement: ResourceManager | None = None
    colocation: Colocation | None = None
    timer: PhaseTimer = field(default_factory=PhaseTimer)
    current_phase: str | None = None
    restarted: list[str] = field(default_factory=list)  # '<role> at step <n>', one per restart
    sync_stats: dict[str, float] = field(default_factory=dict)  # the last weight sync's rate, until popped
    weight_group_formed: bool = False  # the 'collective' transport's group (formed again after restarts)
    engine_headroom_gb: float | None = None  # GPU memory to spare beside the awake engine (``_staying``)
    resident_headroom_gb: float | None = None  # the same with nothing moved at all
    share_hint_shown: bool = False  # ``share_hint`` is printed once a run
    host_sync_said: bool = False  # ``_both_fit``'s fallback is said once a run
    weights_bytes: int = 0  # the last weight sync's bytes (``_weights_fit`` weighs them)
    # the sleeping engine's weights woken alone for an 'ipc' load (``_share_into_sleeping_engine``): its
    # calls pass the residency check while its KV cache stays asleep
    engine_weights_awake: bool = False

    # -- the roles, typed (None where the run does not start the role) --
    @property
    def actor_train(self) -> TrainerGroup | None:
        return self.groups.get("actor_train")

    @property
    def actor_infer(self) -> EngineGroup | None:
        return self.groups.get("actor_infer")

    @property
    def reference(self) -> TrainerGroup | None:
        return self.groups.get("reference")

    @property
    def critic(self) -> CriticGroup | None:
        return self.groups.get("critic")

    @property
    def reward(self) -> RewardGroup | None:
        return self.groups.get("reward")

    @property
    def env(self) -> EnvGroup | None:
        return self.groups.get("env")

    @property
    def teacher(self) -> TeacherSet | None:
        return self.groups.get("teacher")

    @property
    def learned_reward(self) -> LearnedRewardGroup | None:
        return self.groups.get("learned_reward")

    @classmethod
    def start(cls, cfg: RunConfig, *, generate_only: bool = False) -> Roles:
        """Start every role ``run_roles(cfg)`` names, where ``placement`` puts them (``generate_only``: a
        ``reroll generate`` run, which trains nothing); a role that fails to start stops the ones
        already started."""
        if cfg.runtime.backend == "ray":
            start_ray(cfg.runtime.ray_address)
        stacks.configure(cfg.run_dir)  # where a call past its bound writes every worker's stack
        placement = ResourceManager(cfg, generate_only=generate_only)
        cfg = placement.cfg  # device type resolved, for the workers
        if cfg.runtime.backend == "ray":
            try:  # what each node of a joined cluster lacks, before any worker starts there
                pool = set(placement.bundle_nodes.values())
                check_nodes(cfg, placement.device_type, pool, run_dir=not generate_only)
            except BaseException:
                placement.shutdown()
                raise
        specs = run_roles(cfg, placement.device_type, generate_only=generate_only)
        groups: dict[str, Any] = {}
        try:
            for name in specs:
                build = GROUPS[name]
                if build is not None:
                    groups[name] = build(cfg)
        except BaseException:
            for group in groups.values():
                group.shutdown()
            placement.shutdown()
            raise
        roles = cls(cfg, groups, specs, placement=placement)
        if roles.actor_infer is not None and roles.actor_train is not None:
            roles.actor_infer.policy_version = lambda: roles.actor_train.weights_version  # type: ignore[union-attr]
        placed = {name: groups[name] for name, spec in specs.items() if spec.on_pool and name in groups}
        offload = offload_between_phases(cfg, placement.device_type)
        roles.colocation = Colocation(placed, placement.map, offload)
        if roles.colocation.offloads:
            for group in placed.values():
                group.residency_check = roles._check_resident
            if "actor_infer" in placed and engine_may_stay(cfg, placement.device_type):
                roles.colocation.let_stay(roles._staying)
        return roles

    def _staying(self) -> set[str]:
        """The roles left resident at an eviction (``reroll.pipelines.residency.staying``), with the
        headrooms behind the choice kept for the metrics; the share that would keep the engine awake is
        said once."""
        assert self.colocation is not None and self.colocation.map is not None
        found = staying(self.cfg, self.colocation.groups, self.colocation.map.colocated)
        self.engine_headroom_gb = None if found.engine is None else found.engine / 2**30
        self.resident_headroom_gb = None if found.resident is None else found.resident / 2**30
        hint = found.hint()
        if hint is not None and not self.share_hint_shown:
            self.share_hint_shown = True
            tqdm.write(hint)
        return found.roles

    @contextmanager
    def phase(self, name: str, *uses: str) -> Iterator[None]:
        """A named, timed phase whose roles ``uses`` hold their devices (colocated others are offloaded
        first; that move is timed as ``timing/offload`` / ``timing/reload``, not as this phase). A role
        failing inside raises its ``RoleError`` naming this phase."""
        self.hold(*uses)
        outer, self.current_phase = self.current_phase, name
        moved = self._move_seconds()
        try:
            with self.timer(name):
                yield
        except RoleError as e:
            raise self._explained(e).in_phase(name) from e
        finally:
            self.current_phase = outer
            # a move inside the phase (``hold``: a weight sync through host memory evicts the trainer)
            # is timing/offload or timing/reload, not this phase's too
            self.timer.add({name: moved - self._move_seconds()})

    def _move_seconds(self) -> float:
        """The seconds the colocation's offloads and reloads took since its last ``pop_seconds``."""
        return sum(self.colocation.seconds.values()) if self.colocation is not None else 0.0

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
        if role in self.colocation.offloaded and not (role == "actor_infer" and self.engine_weights_awake):
            phase = self.current_phase or "(outside any phase)"
            raise RuntimeError(
                f"{role} was called in phase {phase!r} while offloaded (another role holds its device): "
                f"name it in the phase, `with roles.phase({phase!r}, {role!r}, ...)`"
            )

    def sync_weights(self) -> float:
        """actor_train's weights into actor_infer (gathered while the trainer holds its device), or only
        the LoRA adapters where ``strategy.lora.sync`` is 'adapters'. Returns the bytes sent
        (``sync/bytes``); its rate (``sync/gb_per_s``: bytes over the seconds of the whole sync, which
        ``timing/weight_sync`` shows but for a move it makes, timed as ``timing/offload``/``reload``) and, with the ``collective`` transport, the bytes that went
        through the group (``sync/bytes_collective``) come with the next ``pop_timings``."""
        actor, engine = self.actor_train, self.actor_infer
        assert actor is not None and engine is not None, (
            "sync_weights: this run has no actor_train or actor_infer"
        )
        began = time.perf_counter()
        stats: dict[str, float] = {}
        with self.phase("weight_sync", "actor_train"):
            if self.cfg.strategy.synced_adapters is not None:  # small: through the object store
                update = actor.adapter_update()
                sent = actor.sync_bytes()
                self.hold("actor_infer")
                engine.update_lora(update.tensors, update.config)
            else:
                transport = weight_sync_transport(self.cfg, self.cfg.placement.device_type)
                if transport == "collective":
                    sent, stats = self._broadcast_weights()
                elif transport == "ipc" and self._both_fit():
                    sent = self._share_weights()
                elif transport == "ipc" and self._weights_fit():
                    sent = self._share_into_sleeping_engine()
                else:  # object_store, or an 'ipc' sync whose two roles cannot hold the device together
                    buckets = actor.weight_buckets(self.cfg.rollout.weight_sync_bucket_mb, "object_store")
                    sent = actor.sync_bytes()  # runs once the buckets are made
                    self.hold("actor_infer")
                    engine.load_weight_buckets(buckets)
            engine.weights_version = actor.weights_version
        self.weights_bytes = int(sent)
        seconds = time.perf_counter() - began
        self.sync_stats = stats | {"sync/gb_per_s": sent / seconds / 1e9}
        return float(sent)

    def _broadcast_weights(self) -> tuple[int, dict[str, float]]:
        """The ``collective`` transport: both roles resident (placement keeps them apart), the group
        formed if this is the first sync since either role (re)started, then each bucket broadcast
        as it is gathered. A failure leaves the group to be formed again at the next sync."""
        actor, engine = self.actor_train, self.actor_infer
        assert actor is not None and engine is not None
        self.hold("actor_train", "actor_infer")
        try:
            if not self.weight_group_formed:
                backend = "nccl" if self.cfg.placement.device_type == "cuda" else "gloo"
                form_weight_group(actor, engine, backend)
                self.weight_group_formed = True
            buckets = actor.weight_buckets(self.cfg.rollout.weight_sync_bucket_mb, "collective")
            engine.load_weight_buckets(buckets)
        except RoleError:
            self.weight_group_formed = False
            raise
        return actor.sync_bytes(), {"sync/bytes_collective": float(actor.collective_bytes())}

    def _both_fit(self) -> bool:
        """Whether actor_train may stay resident beside the awake engine for an 'ipc' sync, which holds
        both for its length: always where nothing offloads; else where the trainers' measured memory
        leaves the engine awake beside them (``_staying``; not on the first step, which measures).
        Otherwise this sync goes through host memory as the trainer leaves the device (said once):
        on one GPU the 3B shape's trainer did not fit beside the engine."""
        c = self.colocation
        if c is None or not c.offloads:
            return True
        if c.stays is not None and "actor_infer" in c.stays():
            return True
        if not self.host_sync_said and self.engine_headroom_gb is not None:  # measured: say why once
            self.host_sync_said = True
            tqdm.write(
                "weight sync: actor_train and the awake engine do not fit on their device together: the "
                "engine's weights alone wake for the sync where they fit beside the trainer's state, else "
                "the weights go through host memory while the trainer leaves (rollout.weight_sync_transport "
                "'ipc' needs both resident)"
            )
        return False

    def _weights_fit(self) -> bool:
        """Whether an 'ipc' sync can load into a sleeping engine's weights alone (``wake_weights``: its
        KV cache left asleep) while actor_train stays resident: an engine whose spec can
        (``wakes_weights_alone``), asleep now, and, by the trainers' measured memory, their state
        (each resident colocated trainer's resting bytes), the weights of the last sync and a CUDA
        context for each process on the GPU under 90 % of it. Not at the first sync (nothing measured
        yet). Where an engine must sleep through the trainers' phases (the 3B row with the trainer's
        phase filling the GPU, H100, 2026-12-07), the host path this saves took 20 s of a 28 s step."""
        c, engine = self.colocation, self.actor_infer
        spec = engine_spec(self.cfg.rollout.engine)
        if c is None or engine is None or not spec.wakes_weights_alone or "actor_infer" not in c.offloaded:
            return False
        if not self.weights_bytes or not c.map:
            return False
        needs = colocated_needs(c.groups, c.map.colocated)
        if not needs:
            return False
        resident = [need for name, need in needs.items() if name not in c.offloaded]
        if not all(gpu for *_, gpu in resident):  # a resident trainer not measured yet
            return False
        rest = sum(resting for _, resting, _ in resident)
        total = max(gpu for *_, gpu in needs.values())
        processes = len(needs) + 1  # the trainers' and the engine's
        return rest + self.weights_bytes + processes * 2**30 <= USABLE * total

    def _share_into_sleeping_engine(self) -> int:
        """An 'ipc' sync into a sleeping engine (``_weights_fit``): its weights woken alone, loaded from
        the resident trainer over CUDA IPC as ``_share_weights`` does, then the trainer leaves the GPU
        (if it must) and the engine's KV cache comes back. Returns the bytes of the weights."""
        engine = self.actor_infer
        assert engine is not None
        engine.wake_weights()
        self.engine_weights_awake = True
        try:
            sent = self._stream_shared(finish=False)
        finally:
            self.engine_weights_awake = False
        self.hold("actor_infer")  # the rest of the engine wakes; the trainer moves where it must
        engine.finish_weight_update()  # the prefix cache is dropped once the engine is awake
        return sent

    def _share_weights(self) -> int:
        """The 'ipc' transport: both roles resident; every trainer rank gathers each bucket and those
        beside engine workers share it (``ipc_senders``); the engines load bucket b while the trainers
        make b + 1, and a trainer frees a buffer once its loads are done (two buckets held at most).
        Returns the bytes of the weights (``sync/bytes``)."""
        self.hold("actor_train", "actor_infer")
        return self._stream_shared(finish=True)

    def _stream_shared(self, *, finish: bool) -> int:
        """The buckets of an 'ipc' sync from the trainer ranks into the engines (see ``_share_weights``);
        ``finish``: the engines then drop their prefix caches."""
        actor, engine = self.actor_train, self.actor_infer
        assert actor is not None and engine is not None
        cfg = self.cfg
        actor.begin_share(cfg.rollout.weight_sync_bucket_mb, ipc_senders(cfg, cfg.placement.device_type))
        loads: list[Any] = []
        try:
            while (shared := actor.share_next()) is not None:  # frees what was loaded before ``loads``
                engine.wait_loaded(loads)
                loads = engine.submit_shared(shared)
            engine.wait_loaded(loads)
            if finish:
                engine.finish_weight_update()
        except RoleError:
            with suppress(RoleError):  # the first failure is the one to report
                actor.release_shared()
            raise
        actor.release_shared()
        return actor.sync_bytes()

    @property
    def engine_stale(self) -> bool:
        """Whether actor_train has stepped or loaded since actor_infer last received its weights."""
        actor, engine = self.actor_train, self.actor_infer
        return actor is not None and engine is not None and engine.weights_version != actor.weights_version

    def sync_if_stale(self) -> dict[str, float]:
        """Sync the engine if actor_train has stepped or loaded since: ``{"sync/bytes": ...}`` or ``{}``."""
        return {"sync/bytes": self.sync_weights()} if self.engine_stale else {}

    def restart(self, role: str) -> None:
        """A fresh worker group for ``role`` (one of its workers died), resident on its devices. What it
        held comes back where this can give it: an engine gets actor_train's current weights, the
        reference its snapshot; judge restarts the reward workers too (they hold its handles).
        actor_train and critic come back as built: ``_recover`` loads their checkpoint."""
        name = "reward" if role == "judge" else role
        group = self.groups.get(name)
        if group is None:
            raise ValueError(f"no role {role!r} in this run to restart")
        if self.colocation is not None:  # colocated others leave the device before the new workers load
            self.colocation.offloaded.discard(group.role)
            self.colocation.use(group.role)
        if name in ("actor_train", "actor_infer"):
            self.weight_group_formed = False  # a new member: the next sync forms the group again
        if role == "judge":
            group.restart(judge=True)
        else:
            group.restart()
        if name == "actor_train":
            group.weights_version += 1  # back to model.path's weights: the engine's are stale
        elif name == "actor_infer" and self.actor_train is not None:
            self.sync_weights()
        elif name == "reference":
            with self.phase("recover", "reference"):
                # a node that joined since may hold the restarted ranks
                node_copies.share_reference(self.cfg.storage_url, self.cfg.run_dir)
                group.load(self.cfg.run_dir / checkpoint.REFERENCE)

    @contextmanager
    def profiled(self, step: int) -> Iterator[None]:
        """With ``step`` in ``logging.profile_steps``: torch.profiler in every trainer rank for the
        step's work, written under ``<run dir>/profile`` when the step ends (a step that fails writes
        nothing)."""
        trainers = [g for name, g in self.groups.items() if name in ("actor_train", "reference", "critic")]
        if step not in self.cfg.logging.profile_steps or not trainers:
            yield
            return
        for group in trainers:
            group.profile_start(step)
        yield
        directory = self.cfg.run_dir / "profile"
        written = [path for group in trainers for path in group.profile_stop(directory)]
        tqdm.write(f"profile of step {step}: {len(written)} files in {shown(directory)}")

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
        first = [n for n in SHUTDOWN_FIRST if n in self.groups]
        for name in [*first, *(n for n in self.groups if n not in first)]:
            self.groups[name].shutdown()
        if self.placement is not None:
            self.placement.shutdown()
