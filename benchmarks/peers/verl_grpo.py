"""verl's GRPO steps for ``benchmarks/grpo_step.py``'s ``verl`` row, in a process of its own.

    python benchmarks/peers/verl_grpo.py SPEC.json     # SPEC: benchmarks/peers/spec.py's PeerSpec

verl 0.9.1 as its GRPO examples run it on one GPU: ``verl.trainer.main_ppo`` (Hydra config, Ray), an FSDP
actor and reference, and its vLLM rollout in the hybrid engine (``rollout.mode: async``, the engine asleep
while the actor trains, weights handed over in GPU memory). The same model, prompts (``spec.prompts`` x
``spec.group``), lengths, learning rate, temperature and micro-batch as the reroll rows; the KL term is
verl's GRPO form, ``use_kl_loss`` with ``kl_loss_coef`` = ``spec.beta`` (``low_var_kl``, TRL's k3); one
optimizer step per batch (``ppo_mini_batch_size`` = the prompts of a step). verl's defaults otherwise, with
two exceptions, each because of what the GPU machine can take along, not for speed: the trainers' attention
is ``sdpa`` over padded rows (``use_remove_padding: false``), since verl's packed rows need the
``flash-attn`` package, which is not in the image and too large to carry (verl's fastest setup packs), and
activation checkpointing is off at 0.5B as in reroll's row (verl's default turns it on).

With ``spec.lora`` the actor trains adapters (``model.lora_rank``, ``lora_alpha``, ``target_modules``:
reroll's ``strategy.lora``; the reference is the actor with its adapters off, and the rollout loads the
weights as ``safetensors``, verl's LoRA setup); with ``spec.offload`` the actor's parameters and optimizer
state and the reference's parameters leave the GPU between phases (``fsdp_config.param_offload`` and
``optimizer_offload``), verl's way to fit a full fine-tuning step the GPU cannot hold beside the rest.

Its needs beyond the vLLM bundle (``hydra-core``, ``omegaconf``, ``tensordict``, ``transferqueue``, ``trl==0.27.0``, ...) come in
``.devbundle/verl.tar.xz``. Pins verl declares and the GPU image does not meet: ``transformers<5.11`` (the
image has 5.17) and, for its vllm extra, ``vllm==0.24.0`` (the bundle has 0.25.0).
Writes ``spec.out``: one ``{"step": seconds, "new_tokens": n, "phases": {...}}`` per step, from verl's
own per-step log (``timing_s/step``: its step's wall time).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.peers.spec import PeerSpec

REWARD = '''def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    """The reroll rows' reward: the share of digits in the response."""
    return sum(c.isdigit() for c in solution_str) / max(len(solution_str), 1)
'''


def write_data(spec: PeerSpec, work: Path) -> Path:
    import pandas as pd

    prompts = json.loads(Path(spec.prompts_file).read_text())
    rows = [
        {
            "data_source": "bench",
            "prompt": [{"role": "user", "content": p}],  # in the model's chat template, as reroll's rows
            "ability": "bench",
            "reward_model": {"style": "rule", "ground_truth": "0"},
            "extra_info": {"index": i},
        }
        for i, p in enumerate(prompts)
    ]
    path = work / "train.parquet"
    pd.DataFrame(rows).to_parquet(path)
    return path


def verl_model(spec: PeerSpec, work: Path) -> Path:
    """``spec.model`` as verl can open it: the same weights (linked) and a tokenizer that also knows a
    newline and ``<|im_end|>`` and is as long as the model's vocabulary.

    verl's agent loop picks its Qwen turn handling from ``model_type: qwen2`` and refuses a tokenizer
    without those two tokens ("Expected Qwen newline to tokenize to one token"); the bench's character
    tokenizer has neither. And verl's rollout sets every logit at or past ``len(tokenizer)`` to -inf
    (``monkey_patch_compute_logits``): with the character tokenizer's ~40 tokens it sampled from those
    alone, end of sequence among them, and its responses averaged 43 tokens where every other row's run
    to the cap (H100, 2026-12-07: rollout log-perplexity 3.6 against the actor's 11.8). So the
    tokenizer's vocabulary is filled up to the model's with tokens no text encodes to (a BPE without
    merges never makes a token of several characters), the two new tokens last: the prompts tokenize as
    they do for the other rows and the engine samples from the whole vocabulary, as theirs do."""
    from transformers import AutoConfig, AutoTokenizer

    src, out = Path(spec.model), work / "model"
    out.mkdir(exist_ok=True)
    for f in src.iterdir():
        if not (out / f.name).exists():
            (out / f.name).symlink_to(f.resolve())
    for f in out.iterdir():  # the tokenizer's files are written anew, not through the links
        if f.is_symlink() and ("token" in f.name or f.name == "chat_template.jinja"):
            f.unlink()
    AutoTokenizer.from_pretrained(src).save_pretrained(out)
    size = AutoConfig.from_pretrained(src).vocab_size
    tokenizer_json = out / "tokenizer.json"
    data = json.loads(tokenizer_json.read_text())
    vocab = data["model"]["vocab"]
    ids = set(vocab.values()) | {t["id"] for t in data["added_tokens"]}
    taken = len(ids)
    if ids != set(range(taken)):
        raise SystemExit(f"verl row: {src}'s tokenizer ids are not 0..{taken - 1}, so it cannot be filled up")
    for i in range(size - 2 - taken):
        vocab[f"fill{i}"] = taken + i
    tokenizer_json.write_text(json.dumps(data))
    tok = AutoTokenizer.from_pretrained(out)
    tok.add_tokens(["\n"])
    tok.add_special_tokens({"additional_special_tokens": ["<|im_end|>"]})
    tok.save_pretrained(out)
    return out


def overrides(spec: PeerSpec, work: Path, data: Path, model: Path | None = None) -> list[str]:
    """verl's Hydra overrides for ``spec`` (``model``: the model directory verl opens, ``verl_model``'s;
    default ``spec.model``)."""
    a, r, m = "actor_rollout_ref.actor", "actor_rollout_ref.rollout", "actor_rollout_ref.model"
    micro = min(spec.micro_batch, spec.prompts * spec.group)
    return [
        "algorithm.adv_estimator=grpo",
        "algorithm.use_kl_in_reward=false",
        f"data.train_files={data}",
        f"data.val_files={data}",
        f"data.train_batch_size={spec.prompts}",
        f"data.max_prompt_length={spec.prompt_len + 8}",
        f"data.max_response_length={spec.new_tokens}",
        "data.shuffle=false",
        "data.dataloader_num_workers=0",
        "data.filter_overlong_prompts=false",
        "data.truncation=error",
        f"{m}.path={model or spec.model}",
        f"+{m}.override_config.attn_implementation=sdpa",
        f"{m}.use_remove_padding=false",
        f"{m}.enable_gradient_checkpointing={str(spec.gradient_checkpointing).lower()}",
        f"{a}.optim.lr={spec.lr}",
        f"{a}.ppo_mini_batch_size={spec.prompts}",
        f"{a}.ppo_micro_batch_size_per_gpu={micro}",
        f"{a}.use_kl_loss={str(spec.beta > 0).lower()}",
        f"{a}.kl_loss_coef={spec.beta}",
        f"{a}.kl_loss_type=low_var_kl",
        f"{a}.entropy_coeff=0",
        f"{a}.fsdp_config.param_offload={str(spec.offload).lower()}",
        f"{a}.fsdp_config.optimizer_offload={str(spec.offload).lower()}",
        f"{r}.name=vllm",
        f"{r}.n={spec.group}",
        f"{r}.temperature=1.0",
        f"{r}.tensor_model_parallel_size=1",
        f"{r}.gpu_memory_utilization={spec.vllm_memory}",
        f"{r}.max_model_len={spec.prompt_len + spec.new_tokens + 8}",
        f"{r}.log_prob_micro_batch_size_per_gpu={micro}",
        f"actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu={micro}",
        f"actor_rollout_ref.ref.fsdp_config.param_offload={str(spec.offload).lower()}",
        f"reward.custom_reward_function.path={work / 'bench_reward.py'}",
        "reward.custom_reward_function.name=compute_score",
        "trainer.n_gpus_per_node=1",
        "trainer.nnodes=1",
        f"trainer.total_training_steps={spec.steps}",
        "trainer.total_epochs=1",
        "trainer.val_before_train=false",
        "trainer.test_freq=-1",
        "trainer.save_freq=-1",
        "trainer.logger=[console,file]",
        "trainer.project_name=bench",
        "trainer.experiment_name=verl",
        f"trainer.default_local_dir={work / 'ckpt'}",
        *lora_overrides(spec),
    ]


def lora_overrides(spec: PeerSpec) -> list[str]:
    """verl's LoRA settings for ``spec.lora`` (reroll's ``strategy.lora`` section); none without."""
    if spec.lora is None:
        return []
    m = "actor_rollout_ref.model"
    return [
        f"{m}.lora_rank={spec.lora['rank']}",
        f"{m}.lora_alpha={spec.lora['alpha']:g}",  # an int in verl's config: 32, not 32.0
        f"{m}.target_modules=[{','.join(spec.lora['target_modules'])}]",
        "actor_rollout_ref.rollout.load_format=safetensors",
    ]


def read_steps(log: Path, spec: PeerSpec) -> list[dict]:
    """Each step's wall time and new tokens from verl's file logger (``timing_s/*`` in seconds)."""
    out = []
    for line in log.read_text().splitlines():
        data = json.loads(line).get("data", {})
        if "timing_s/step" not in data:
            continue
        phases = {k.removeprefix("timing_s/"): v for k, v in data.items() if k.startswith("timing_s/")}
        tokens = data.get("response_length/mean", 0.0) * spec.prompts * spec.group
        lengths = {
            "mean_length": data.get("response_length/mean", 0.0),
            "max_length": data.get("response_length/max", 0.0),
        }
        out.append({"step": data["timing_s/step"], "new_tokens": tokens, **lengths, "phases": phases})
    return out


def verl_first(pythonpath: str) -> str:
    """``pythonpath`` with verl's bundle first: it holds the TRL verl imports (0.27.0, verl's pin, whose
    ``trl.experimental.ppo`` TRL 1.16 in the vLLM bundle no longer has), ahead of the TRL rows' 1.16."""
    import importlib.util

    spec = importlib.util.find_spec("verl")
    if spec is None or spec.origin is None:
        return pythonpath
    site = str(Path(spec.origin).parents[1])
    return os.pathsep.join([site, *(p for p in pythonpath.split(os.pathsep) if p and p != site)])


def run(spec: PeerSpec) -> list[dict]:
    work = Path(spec.out).parent / "verl-work"
    work.mkdir(parents=True, exist_ok=True)
    (work / "bench_reward.py").write_text(REWARD)
    data = write_data(spec, work)
    log = work / "verl.jsonl"
    env = os.environ | {"VERL_FILE_LOGGER_PATH": str(log), "WANDB_MODE": "disabled"}
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # reroll's setting for its in-process engine: verl's own
    env["PYTHONPATH"] = verl_first(env.get("PYTHONPATH", ""))
    cmd = [
        sys.executable,
        "-m",
        "verl.trainer.main_ppo",
        *overrides(spec, work, data, verl_model(spec, work)),
    ]
    print("verl:", " ".join(cmd), flush=True)
    done = subprocess.run(cmd, env=env, cwd=work)
    if done.returncode:
        raise SystemExit(f"verl.trainer.main_ppo exited {done.returncode}")
    return read_steps(log, spec)


if __name__ == "__main__":
    spec = PeerSpec.read(Path(sys.argv[1]))
    Path(spec.out).write_text(json.dumps(run(spec)))
