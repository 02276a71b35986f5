"""Where and how a run runs: ``placement``, ``runtime``, and the loop's ``eval``, ``checkpoint`` and ``logging``."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from reroll.config.base import StrictModel


class EvalConfig(StrictModel):
    """Held-out evaluation: greedy decoding, scored by the reward."""

    every: int = Field(10, ge=0, description="Evaluate every N steps (0: only before and after training).")


class CheckpointConfig(StrictModel):
    """Checkpoints in Hugging Face format plus what resuming needs."""

    every: int = Field(0, ge=0, description="Save every N steps (0: only at the end).")
    keep_last: int = Field(2, ge=1, description="Keep the newest N checkpoints.")
    at_end: bool = Field(
        True,
        description="Save at the run's last step too, whatever `every` says. false: the run's end saves "
        "nothing (a benchmark, a throwaway try: a 7B LoRA run's final save took 94 s on an H100 machine), "
        "so its last steps can be neither resumed nor loaded.",
    )
    storage: str | None = Field(
        None,
        description="A copy of the run in remote storage, so --resume continues on a machine whose disk "
        "is gone (a preempted VM): any fsspec URL ('s3://bucket/runs/{name}', 'gs://...', 'az://...'; "
        "pip install s3fs, gcsfs or adlfs) or a path on another mounted disk; '{name}' is replaced by "
        "the name. Each complete checkpoint is copied there after its local save (its marker last; "
        "keep_last applies there too), and the metrics, config and TensorBoard files after the step. "
        "--resume downloads the newest complete one when the run directory has none as new. On a Ray "
        "cluster whose nodes do not share output_dir, each node's part of a checkpoint goes through it.",
    )


class LoggingConfig(StrictModel):
    """Where metrics go."""

    tensorboard: bool = Field(True, description="Write TensorBoard event files.")
    wandb: bool = Field(False, description="Log to Weights & Biases (pip install 'reroll[tracking]').")
    wandb_project: str = Field("reroll", description="W&B project.")
    mlflow: bool = Field(
        False,
        description="Log the resolved config as params and the metrics per step to MLflow (pip install "
        "'reroll[mlflow]'; 'reroll[tracking]' has the client for a tracking server).",
    )
    mlflow_experiment: str = Field("reroll", description="MLflow experiment (made if missing).")
    mlflow_tracking_uri: str | None = Field(
        None,
        description="MLflow store: a server ('http://host:5000'), 'sqlite:///mlflow.db', ... (default: "
        "MLFLOW_TRACKING_URI, else MLflow's own default).",
    )
    sample_every: int = Field(10, ge=0, description="Log one sample completion every N steps (0: never).")
    profile_steps: list[Annotated[int, Field(ge=1)]] = Field(
        default_factory=list,
        description="Steps whose work in the model-holding trainer roles (actor_train, reference, critic: "
        "forward, backward, optimizer step, log-probs) torch.profiler records. Each rank writes "
        "profile/<role>-<rank>-step<N>.json.gz (a trace for Perfetto or chrome://tracing) and "
        "profile/<role>-<rank>-step<N>.txt (operators by self device time and by self host time) in the "
        "run's directory (ranks sharing one process, runtime.backend local, share one recording, named "
        "after all of them: actor_train-0+reference-0-step<N>). Those steps run slower.",
    )


class PlacementConfig(StrictModel):
    """The device pool the model roles (actor_train, actor_infer, reference, critic) are placed on."""

    devices: int | None = Field(
        None,
        ge=1,
        description="Devices in the pool: GPUs, or CPU slots of cpus_per_device on a CPU-only cluster. "
        "None: no pool; Ray places each worker by its role's num_gpus/num_cpus_per_worker, except on a "
        "machine with a GPU where no role asks for GPUs: there the model roles share one GPU (a pool of "
        "1, as a one-GPU user means; config.yaml records it).",
    )
    device_type: Literal["auto", "cuda", "cpu"] = Field(
        "auto", description="What a pool device is; 'auto': GPUs if the Ray cluster has any, else CPUs."
    )
    cpus_per_device: float = Field(1.0, gt=0, description="CPU cores reserved with each pool device.")
    offload: Literal["auto", "always", "never"] = Field(
        "auto",
        description="Colocated roles offload their state between phases: 'auto' on GPUs only, where a "
        "trainer role stays resident when its measured memory fits beside the engine's share "
        "(rollout.vllm.gpu_memory_utilization), and the vLLM engine sleeps (rollout.vllm.sleep_level) "
        "unless, in rlvr and distill from the second step, the worst trainer phase (one trainer's "
        "measured peak scaled to responses of rollout.max_new_tokens, the other trainers' state) fits "
        "beside its share too (placement/actor_infer_stayed says which, placement/engine_headroom_gb "
        "by how much), and nothing moves where every trainer's peak fits beside it at once "
        "(placement/resident_headroom_gb); 'always' (every role moves; on CPUs it moves nothing but "
        "exercises the path), 'never' (nothing moves: everything must fit at once).",
    )


class RuntimeConfig(StrictModel):
    """How roles are run."""

    backend: Literal["ray", "local"] = Field(
        "ray", description="'ray': each worker a Ray actor; 'local': all in this process (debugging)."
    )
    ray_address: str | None = Field(
        None,
        description="Join the Ray cluster at this address (host:port of `ray start --head`); unset: the "
        "RAY_ADDRESS environment variable (set by `ray job submit`) if any, else start a local cluster.",
    )
    call_timeout_s: float = Field(
        1800.0,
        gt=0,
        description="Longest one role call may take; past it the run stops, naming the role and phase, "
        "with every worker's Python stack written to <run dir>/stacks/.",
    )
    max_restarts: int = Field(
        3,
        ge=0,
        description="Dead workers restarted per run (a killed or crashed process, not an exception in "
        "it): the role is restarted, given the current weights, and the step retried; actor_train or "
        "critic go back to the latest checkpoint (the steps since are redone: checkpoint.every bounds "
        "them). Past this many the run stops with the worker's error. 0: never restart.",
    )
