"""Workers as Ray actors (or, for debugging, plain objects in this process) and bounded waits on them.

A ``WorkerGroup`` owns one role's ranks. Role-specific groups (``reroll.roles``) add typed methods
that shard inputs, call each rank's method and gather results through ``gather``, which turns a dead
actor or a timeout into a ``RoleError`` naming the role, rank and phase: the driver never hangs.
"""

from __future__ import annotations

import functools
import itertools
import json
import logging
import os
import re
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from reroll.errors import RoleError
from reroll.runtime import quiet, stacks
from reroll.runtime.placement import actor_options

if TYPE_CHECKING:
    from reroll.config.schema import RunConfig

T = TypeVar("T")

log = logging.getLogger(__name__)


@dataclass
class _Ready:
    """A result already computed in this process (local backend)."""

    value: Any = None
    error: BaseException | None = None


def _value(arg: Any) -> Any:
    if isinstance(arg, _Ready):
        if arg.error is not None:
            raise arg.error
        return arg.value
    return arg


class _LocalMethod:
    def __init__(self, fn: Callable[..., Any]) -> None:
        self._fn = fn

    def options(self, **_: Any) -> _LocalMethod:
        """Ray call options (a concurrency group) mean nothing in this process."""
        return self

    def remote(self, *args: Any, **kwargs: Any) -> _Ready:
        """Runs now; a result of an earlier call passed as an argument is its value (as Ray passes
        an object reference's), and its failure is this call's."""
        try:
            args = tuple(_value(a) for a in args)
            kwargs = {k: _value(v) for k, v in kwargs.items()}
            return _Ready(self._fn(*args, **kwargs))
        except Exception as e:  # re-raised by gather with the role and rank
            return _Ready(error=e)


class LocalHandle:
    """Wraps an object so ``handle.method.remote(...)`` runs it now, like a Ray actor call."""

    def __init__(self, obj: Any) -> None:
        self._obj = obj

    def __getattr__(self, name: str) -> _LocalMethod:
        return _LocalMethod(getattr(self._obj, name))


def start_ray(address: str | None) -> None:
    """Join the cluster at ``address``, else at ``RAY_ADDRESS`` (what ``ray job submit`` sets for its
    driver), else start a local one (once per process).

    Joining by address, Ray does not turn on token authentication by itself, while ``ray start`` turns
    it on where a token exists (``~/.ray/auth_token``, ``RAY_AUTH_TOKEN``): so does this, unless
    ``RAY_AUTH_MODE`` says otherwise. Under ``ray job submit`` the job's runtime environment comes
    first: its environment variables are kept and only the others added."""
    import ray

    if ray.is_initialized():
        return
    joining = address or os.environ.get("RAY_ADDRESS")
    if joining:
        _token_auth_like_ray_start()
    env = quiet.ray_runtime_env()  # third-party notices hidden in workers too, unless --verbose
    env["env_vars"] |= {"TOKENIZERS_PARALLELISM": "false", "PYTHONWARNINGS": "ignore"}
    # under `ray job submit` the job's runtime env comes first: Ray refuses a variable set twice
    job = json.loads(os.environ.get("RAY_JOB_CONFIG_JSON_ENV_VAR", "{}") or "{}")
    job_vars = ((job.get("runtime_env") or {}).get("env_vars")) or {}
    env["env_vars"] = {k: v for k, v in env["env_vars"].items() if k not in job_vars}
    term = signal.getsignal(signal.SIGTERM)
    ray.init(
        address=address,
        include_dashboard=False,
        log_to_driver=True,
        logging_level=logging.WARNING,
        runtime_env=env,
        configure_logging=True,
    )
    if callable(term) and threading.current_thread() is threading.main_thread():
        # ray.init put its crash-dump handler (a native stack trace) in place of the command's own
        signal.signal(signal.SIGTERM, term)
    if joining:
        nodes = [n for n in ray.nodes() if n.get("Alive")]
        log.info("joined the Ray cluster at %s: %d nodes, %s", joining, len(nodes), ray.cluster_resources())


def _token_auth_like_ray_start() -> None:
    """Turn on Ray's token authentication where a token exists and ``RAY_AUTH_MODE`` is unset, as
    ``ray start`` does for the cluster (Ray versions before token authentication: nothing to do)."""
    try:
        from ray._private.authentication.authentication_token_setup import (
            maybe_enable_token_auth_if_token_available,
        )
    except ImportError:
        return
    maybe_enable_token_auth_if_token_available(warn_if_disabled=False)


def spawn(
    cls: type, args: tuple[Any, ...], *, backend: str, name: str, max_concurrency: int = 1, **options: Any
) -> Any:
    """One worker: a Ray actor with the given ``options`` (resources, scheduling), running up to
    ``max_concurrency`` calls at once in threads, or a ``LocalHandle``."""
    if backend == "local":
        return LocalHandle(cls(*args))
    import ray

    groups = options.pop("concurrency_groups", None)  # Ray takes these at ray.remote only
    actor_cls = ray.remote(concurrency_groups=groups)(cls) if groups else ray.remote(cls)
    return actor_cls.options(name=name, max_concurrency=max_concurrency, **options).remote(*args)


def gather(
    refs: Sequence[Any], *, role: str, phase: str, timeout_s: float, detail: str | None = None
) -> list[Any]:
    """Results of per-rank calls in rank order; a failure or timeout raises ``RoleError`` (with
    ``detail``, what the workers run, e.g. 'vllm engine'). The first rank to fail raises at once, even
    while others still run (a rank that died leaves its peers waiting in a collective). A dead worker's
    error says ``died``; a timeout first writes every worker's stack to the run directory (``stacks``)."""
    fail = functools.partial(RoleError, role, detail=detail)
    if all(isinstance(r, _Ready) for r in refs):
        for rank, r in enumerate(refs):
            if r.error is not None:
                raise fail(rank, phase, f"{type(r.error).__name__}: {r.error}") from r.error
        return [r.value for r in refs]
    import ray

    refs, out = list(refs), {}
    deadline = time.monotonic() + timeout_s
    while len(out) < len(refs):
        pending = [r for r in refs if r not in out]
        ready, _ = ray.wait(pending, num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
        if not ready:
            rank = refs.index(pending[0])
            where = stacks.dump()
            evidence = f"; every worker's Python stack is in {where}" if where else ""
            raise fail(rank, phase, f"no answer within {timeout_s:.0f} s (runtime.call_timeout_s){evidence}")
        for ref in ready:
            out[ref] = _get(ref, refs.index(ref), fail, phase)
    return [out[r] for r in refs]


def stream_items(
    calls: Sequence[Any], *, role: str, phase: str, timeout_s: float, detail: str | None = None
) -> Iterator[tuple[int, Any]]:
    """``(rank, item)`` from per-rank streaming calls (``method.options(num_returns="streaming")``; in
    this process, the generators themselves) as each item is ready. A failure, or no item within
    ``timeout_s``, raises ``RoleError`` as ``gather`` does."""
    fail = functools.partial(RoleError, role, detail=detail)
    if all(isinstance(c, _Ready) for c in calls):
        for rank, c in enumerate(calls):
            try:
                if c.error is not None:
                    raise c.error
                for item in c.value:
                    yield rank, item
            except Exception as e:
                raise fail(rank, phase, f"{type(e).__name__}: {e}") from e
        return
    import ray

    pending = {id(c): (rank, c) for rank, c in enumerate(calls)}
    while pending:
        gens = [c for _, c in pending.values()]
        ready, _ = ray.wait(gens, num_returns=1, timeout=timeout_s)
        if not ready:
            rank = min(r for r, _ in pending.values())
            raise fail(rank, phase, f"no answer within {timeout_s:.0f} s (runtime.call_timeout_s)")
        for gen in ready:
            rank = pending[id(gen)][0]
            try:
                ref = next(gen)
            except StopIteration:
                del pending[id(gen)]
                continue
            yield rank, _get(ref, rank, fail, phase)


def _get(ref: Any, rank: int, fail: Callable[..., RoleError], phase: str) -> Any:
    """A finished call's result, or its failure as a ``RoleError`` (``died`` when the process is gone)."""
    import ray
    from ray.exceptions import RayActorError, RayTaskError

    try:
        return ray.get(ref, timeout=0)
    except RayTaskError as e:
        cause = e.cause if getattr(e, "cause", None) is not None else e
        raise fail(rank, phase, f"{type(cause).__name__}: {cause}") from e
    except RayActorError as e:
        if getattr(e, "actor_init_failed", False):  # keep the constructor's own error (e.g. a UserError)
            cause = constructor_error(str(getattr(e, "error_msg", e)))
            raise fail(rank, phase, f"the worker failed to start: {cause}") from e
        raise fail(rank, phase, f"the worker process died ({e.__class__.__name__})", died=True) from e


_RAISED = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Exit|Interrupt|Warning)\b.*")


def constructor_error(text: str, limit: int = 600) -> str:
    """The error a worker's constructor raised, from the traceback Ray reports: the last line that
    names an exception (``ValueError: ...``), with the indented lines that continue it (a pydantic
    validation error's reason), but not a pointer to documentation; the last line where none does."""
    lines = [ln for ln in text.strip().splitlines() if ln.strip()]
    if not lines:
        return text.strip()
    at = next((i for i in range(len(lines) - 1, -1, -1) if _RAISED.match(lines[i].strip())), None)
    if at is None:
        return lines[-1].strip()[:limit]
    parts = [lines[at].strip()]
    for ln in lines[at + 1 :]:
        if not ln.startswith((" ", "\t")) or ln.strip().startswith("For further information"):
            break
        parts.append(ln.strip())
    return " ".join(parts)[:limit]


def free_address() -> str:
    """``host:port`` of a free TCP port on this node (for a process group's rendezvous)."""
    host = "127.0.0.1"
    try:
        import ray

        if ray.is_initialized():
            host = ray.util.get_node_ip_address()
    except ImportError:
        pass
    with socket.socket() as s:
        s.bind(("", 0))
        return f"{host}:{s.getsockname()[1]}"


class WorkerGroup:
    """The ranks of one role, placed as its ``roles.<name>`` config says. Subclasses add typed methods."""

    def __init__(
        self,
        role: str,
        cls: type,
        make_args: Callable[[int], tuple[Any, ...]],
        cfg: RunConfig,
        *,
        timeout_s: float | None = None,
        concurrency_groups: dict[str, int] | None = None,
        max_concurrency: int = 1,
        name: str | None = None,
    ) -> None:
        """``concurrency_groups``: extra Ray threads by name, for calls that must run while another is
        in flight (``handle.abort.options(concurrency_group="control")``). ``max_concurrency``: calls a
        worker runs at once (threads; the worker's methods must allow it). ``name``: what the workers'
        Ray actors are named after (default: the role), for several groups of one role (teachers)."""
        rc = getattr(cfg.roles, role)
        self.cfg = cfg  # the run config the workers were built from
        self.role, self.world_size = role, rc.world_size
        self.name = name or role
        self.detail: str | None = None  # what the workers run, named in errors ('vllm engine')
        self.timeout_s = timeout_s or cfg.runtime.call_timeout_s
        # set by the run (``Roles``) when the role shares a device: raises if the role is offloaded
        self.residency_check: Callable[[str], None] | None = None
        self.restarts = 0
        self._recipe = (cls, make_args, cfg, concurrency_groups)
        self.max_concurrency = max_concurrency
        self._handles: list[Any] = []
        self._spawn()

    def _spawn(self) -> None:
        cls, make_args, cfg, groups = self._recipe
        local = cfg.runtime.backend == "local"
        suffix = f"-restart{self.restarts}" if self.restarts else ""  # a killed actor's name frees late
        self._handles = [
            spawn(
                cls,
                make_args(rank),
                backend=cfg.runtime.backend,
                name=f"{self.name}-{rank}{suffix}",
                max_concurrency=self.max_concurrency,
                **({} if local else actor_options(cfg, self.role, rank)),
                **({} if local or not groups else {"concurrency_groups": groups}),
            )
            for rank in range(self.world_size)
        ]
        if not local:
            for rank, h in enumerate(self._handles):
                stacks.track(f"{self.name}-{rank}", h)

    def restart(self) -> None:
        """Replace every rank with a fresh worker built as the first was (its state is that of a new
        one): after a rank died, the run's recovery (``reroll.pipelines.run``) restores the rest."""
        log.warning("restarting %s (%d rank%s)", self.role, self.world_size, "s" * (self.world_size > 1))
        self._kill()
        self.restarts += 1
        self._spawn()

    @property
    def handles(self) -> list[Any]:
        """The ranks' handles, for a call into the role: refused while the role is offloaded (a colocated
        role must hold its device first, see ``reroll.pipelines.run.Roles.phase``). ``offload``,
        ``reload`` and ``shutdown`` use ``_handles``, which any state allows."""
        if self.residency_check is not None:
            self.residency_check(self.role)
        return self._handles

    def _wait(self, refs: Sequence[Any], phase: str) -> list[Any]:
        return gather(refs, role=self.role, phase=phase, timeout_s=self.timeout_s, detail=self.detail)

    def _stream(self, rank: int, call: Any, phase: str) -> Iterator[Any]:
        """The items of a generator method's call on ``rank``, as the worker yields them:
        ``handle.method.options(num_returns="streaming").remote(...)`` (or a local call). Each waits
        at most ``timeout_s``; a failure or a dead worker is a ``RoleError`` as in ``gather``."""
        fail = functools.partial(RoleError, self.role, detail=self.detail)
        if isinstance(call, _Ready):
            if call.error is not None:
                raise fail(rank, phase, f"{type(call.error).__name__}: {call.error}") from call.error
            yield from call.value
            return
        import ray

        while True:
            ready, _ = ray.wait([call], timeout=self.timeout_s)
            if not ready:
                raise fail(rank, phase, f"no answer within {self.timeout_s:.0f} s (runtime.call_timeout_s)")
            try:
                ref = next(call)
            except StopIteration:
                return
            yield _get(ref, rank, fail, phase)

    def _deal(self, items: Sequence[T]) -> list[list[T]]:
        """``items`` cut into one contiguous, near-equal block per rank (results concatenate in order)."""
        n = self.world_size
        bounds = [round(i * len(items) / n) for i in range(n + 1)]
        return [list(items[a:b]) for a, b in itertools.pairwise(bounds)]

    def shutdown(self) -> None:
        self._kill()

    def _kill(self) -> None:
        if self._handles and not isinstance(self._handles[0], LocalHandle):
            import ray

            for rank, h in enumerate(self._handles):
                ray.kill(h, no_restart=True)
                stacks.forget(f"{self.name}-{rank}")
        self._handles = []
