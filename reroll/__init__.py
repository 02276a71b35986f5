"""reroll: reinforcement-learning post-training of language models on Ray.

Layers, lowest first. A module imports from its own subpackage and from layers earlier in this
list, never from a later one. Imports inside functions count (they are lazy, not absent), and so do
imports under ``TYPE_CHECKING``: a type a lower layer needs from a higher one becomes a
``Protocol`` in the lower layer. The order has no ties, so no two subpackages import each other, and
inside a subpackage no two modules do either (a type-only import aside).
``tests/unit/test_layers.py`` checks every import against it; this package's ``__init__`` imports
nothing from reroll.

    errors      the exceptions every layer raises
    packages    whether a module can be imported here (the one "is it installed" test)
    config      typed run config (one model per pipeline), strict loader, validation, the role
                registry and device map of a config, what each engine can do
    data        typed records (Sample, Rollout, TrainBatch), datasets, packing
    algorithms  pure tensor functions: advantages, losses, KL, per-token log-probs
    models      loading and forwarding Hugging Face models, the tiny model, Megatron conversion
    strategies  training backends: torch, fsdp2, deepspeed, megatron
    rewards     per-sample reward functions, routing by domain
    envs        multi-turn environments and tools (a tool may score with a reward)
    runtime     Ray actors and bounded waits, placement groups, weight sync, checkpoints, metrics
    engines     generation engines: hf, vllm, sglang
    roles       workers that hold a strategy or an engine (trainer, critic, actor_infer, reward,
                env, teacher, reward model), and the objectives a trainer minimises
    pipelines   the run skeleton, the roles of a run, the rollout source, and the rlvr, sft,
                agentic, reward_model, dpo and distill pipelines
    plan        ``reroll plan``: devices and memory of a config
    cli         the ``reroll`` command
"""

__version__ = "0.1.0"
