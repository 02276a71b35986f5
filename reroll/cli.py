"""The ``reroll`` command: train, validate, plan, generate (sample and score a model or checkpoint),
plot (a run's curves), and offline helpers (tiny model, synthetic data, config docs, environment checks).

User errors (config, files, data) print one message and exit 2, without a traceback; ``--debug``
shows it. A role's failure prints which role, rank and phase failed and exits 1. Third-party notices
that say nothing about the run are hidden (``reroll.runtime.quiet``); ``--verbose`` shows them. A
closed pipe (``reroll config-docs | head``) ends the command quietly with 141, as SIGPIPE would.
Ctrl-C (SIGINT) and ``kill`` (SIGTERM) stop ``train``, ``generate`` and ``serve`` the same way: the
workers are shut down, one line says what can be continued, and the exit code is 130 or 143.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from pathlib import Path

from reroll.errors import RoleError, UserError

log = logging.getLogger("reroll")
VERBOSE_HELP = (
    "show third-party notices that are hidden by default (DeepSpeed's accelerator detection, Ray's token "
    "authentication, vLLM's warnings and loading bars, transformers' progress bars)"
)


class _TqdmHandler(logging.Handler):
    """Log lines that do not break the progress bar."""

    def emit(self, record: logging.LogRecord) -> None:
        from tqdm import tqdm

        tqdm.write(self.format(record), file=sys.stderr)


def _setup_logging(debug: bool, verbose: bool) -> None:
    from reroll.runtime import quiet

    quiet.configure(verbose or debug)
    handler = _TqdmHandler()
    handler.setFormatter(
        logging.Formatter("%(message)s" if not debug else "%(levelname)s %(name)s: %(message)s")
    )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(logging.WARNING)
    logging.getLogger("reroll").setLevel(logging.DEBUG if debug else logging.INFO)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if not (debug or verbose):
        import transformers

        transformers.logging.set_verbosity_error()


def _load(args: argparse.Namespace, *, trains: bool = True):
    """The config ``args`` name, with its overrides; ``trains=False``: checked only for what a command
    that trains nothing reads (``RunConfig.check``)."""
    from reroll.config.loader import load_config
    from reroll.config.schema import RunConfig

    check = None if trains else (lambda cfg: cfg.check(trains=False))
    return load_config(args.config, RunConfig, args.overrides, check)


def cmd_train(args: argparse.Namespace) -> int:
    from reroll.pipelines import pipeline_class
    from reroll.pipelines.run import run

    cfg = _load(args)
    args.run_dir = cfg.run_dir  # what an interrupt's message reads
    result = run(pipeline_class(cfg.pipeline), cfg, resume=args.resume)
    print(result.summary(cfg.name))
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    from reroll.pipelines.generate import default_out, generate

    cfg = _load(args, trains=False)  # the algorithm's needs (GRPO's groups) are not generate's
    out = args.out or default_out(cfg, args.split, args.checkpoint)
    result = generate(cfg, out=out, split=args.split, checkpoint=args.checkpoint, limit=args.limit)
    print(result.table())
    return 0


def cmd_plot(args: argparse.Namespace) -> int:
    from reroll.runtime.plots import plot_runs, split_runs_and_metrics

    runs, metrics = split_runs_and_metrics(args.runs_and_metrics)
    path = plot_runs(runs, metrics, args.out or runs[0] / "plots")
    print(f"wrote {path}")
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from reroll.pipelines.serve import serve

    cfg = _load(args)

    def ready(server) -> None:
        print(f"serving {cfg.name} at {server.url} ({server.describe()}; Ctrl-C stops)", flush=True)

    signal.signal(signal.SIGTERM, _interrupt)  # `kill` stops it as Ctrl-C does, even while it starts
    api_key = args.api_key or os.environ.get("REROLL_API_KEY") or None
    serve(cfg, checkpoint=args.checkpoint, host=args.host, port=args.port, tool_parser=args.tool_parser,
          api_key=api_key, ready=ready)  # fmt: skip
    return 0


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


class Terminated(KeyboardInterrupt):
    """SIGTERM, handled as Ctrl-C is (exit code 143 instead of 130)."""


_terminated: list[int] = []  # the SIGTERMs received (a library may re-raise the interrupt as its own)


def _terminate(signum: int, frame: object) -> None:
    _terminated.append(signum)
    raise Terminated


def _interrupted(args: argparse.Namespace) -> str:
    """The line an interrupted command prints: what can be continued, and how."""
    if args.command == "generate":
        return "interrupted: rerun the same command to continue the output file"
    if args.command != "train":
        return "interrupted"
    from reroll.runtime import checkpoint

    run_dir = getattr(args, "run_dir", None)
    found = checkpoint.latest(run_dir) if run_dir is not None else None
    if found is not None:
        return f"interrupted: the last complete checkpoint, {found}, can be resumed with --resume"
    written = run_dir is not None and any((run_dir / n).exists() for n in ("config.yaml", "metrics.jsonl"))
    if written:
        return (
            f"interrupted before the first checkpoint: nothing to resume; delete {run_dir} to start over "
            f"(checkpoint.every sets how often a run checkpoints)"
        )
    return "interrupted before the run wrote anything: rerun the same command to start"


def cmd_validate(args: argparse.Namespace) -> int:
    from reroll.pipelines.preflight import preflight

    cfg = _load(args)
    warnings = preflight(cfg, f"config {args.config}")  # the checks `train` runs before it starts anything
    count = f"; {len(warnings)} warning{'s' if len(warnings) > 1 else ''}:" if warnings else ""
    print(f"{args.config}: valid ({cfg.pipeline} pipeline, run directory {cfg.run_dir}){count}")
    for warning in warnings:
        print(f"  {warning}")
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    from reroll.plan import plan

    cfg = _load(args)
    text, fits = plan(cfg, gpus=args.gpus, gpu_memory_gib=args.gpu_memory, prompt_tokens=args.prompt_tokens)
    if not fits:
        what = "cannot start" if "\ncannot start:" in text else "the plan does not fit"
        raise UserError(f"{args.config}: {what}\n{text}")
    print(text)
    return 0


def cmd_make_tiny_model(args: argparse.Namespace) -> int:
    from reroll.models.tiny import build_tiny_model, resolve_alphabet

    try:
        alphabet = resolve_alphabet(args.alphabet)
    except ValueError as e:
        raise UserError(f"--alphabet: {e}") from e
    try:
        path = build_tiny_model(
            args.out,
            alphabet=alphabet,
            hidden_size=args.hidden_size,
            num_layers=args.num_layers,
            num_heads=args.num_heads,
            seed=args.seed,
        )
    except ValueError as e:
        raise UserError(str(e)) from e
    print(f"tiny model written to {path}")
    return 0


def cmd_make_data(args: argparse.Namespace) -> int:
    from reroll.data.arithmetic import write_arithmetic_dataset

    made = write_arithmetic_dataset(
        args.out,
        n_train=args.n_train,
        n_test=args.n_test,
        max_operand=args.max_operand,
        ops=args.ops,
        seed=args.seed,
    )
    for split, path in made.items():
        print(f"{split}: {path}")
    return 0


def cmd_env_check(args: argparse.Namespace) -> int:
    import yaml

    from reroll.envs import env_names
    from reroll.envs.check import check_env

    if args.list:
        from reroll.envs.gem import gem_ids, gem_missing

        missing = gem_missing()
        gem = [f"gem:<id> (GEM's environments; {missing})"] if missing else [f"gem:{i}" for i in gem_ids()]
        print("\n".join(env_names() + gem))
        return 0
    if args.name is None:
        raise UserError("env-check: name an environment, e.g. `reroll env-check nim`; --list shows them all")
    bad = [o for o in args.options if "=" not in o]
    if bad:
        raise UserError(f"env-check: environment options are key=value, got {bad[0]!r}")
    config = {k: yaml.safe_load(v) for k, v in (o.split("=", 1) for o in args.options)}
    report = check_env(args.name, config, policy=args.policy, episodes=args.episodes, seed=args.seed)
    print("\n".join(report.transcript[: 2 * args.show_turns + 1]))
    print(report.summary())
    return 0


def cmd_config_docs(args: argparse.Namespace) -> int:
    from reroll.config.schema import config_docs

    print(config_docs())
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="reroll", description="RL post-training of language models on Ray.")
    p.add_argument("--debug", action="store_true", help="show tracebacks and debug logs")
    p.add_argument("--verbose", action="store_true", help=VERBOSE_HELP)
    sub = p.add_subparsers(dest="command", required=True)
    # default=[]: argparse calls a '*' positional without a default required in its usage error
    overrides = {
        "nargs": "*",
        "default": [],
        "metavar": "KEY=VALUE",
        "help": "dotted overrides: rollout.group_size=4 optim.lr=1e-4 (quote text with braces: "
        "'data.prompt_template=\"{question}=\"')",
    }

    t = sub.add_parser("train", help="run the pipeline a config describes")
    t.add_argument("config", type=Path)
    t.add_argument("overrides", **overrides)
    t.add_argument("--resume", action="store_true", help="continue from the run's last complete checkpoint")
    t.add_argument("--verbose", action="store_true", default=argparse.SUPPRESS, help=VERBOSE_HELP)
    t.set_defaults(func=cmd_train)

    g = sub.add_parser(
        "generate",
        help="sample rollout.group_size responses per prompt, score them with the rewards, write JSONL and "
        "print reward, accuracy and pass@k",
    )
    g.add_argument("config", type=Path)
    g.add_argument("overrides", **overrides)
    g.add_argument(
        "--checkpoint",
        type=Path,
        help="a run's checkpoints/step_XXXXXX, its model/ directory, or a run directory (its newest "
        "checkpoint); default: model.path",
    )
    g.add_argument(
        "--out",
        type=Path,
        help="the JSONL file; a rerun skips the prompts it holds (default: "
        "<run dir>/generations/<split>-<step_XXXXXX|base>.jsonl)",
    )
    g.add_argument("--split", choices=["eval", "train"], default="eval", help="which prompts (default: eval)")
    g.add_argument("--limit", type=int, help="only the first N prompts of the split")
    g.add_argument("--verbose", action="store_true", default=argparse.SUPPRESS, help=VERBOSE_HELP)
    g.set_defaults(func=cmd_generate)

    pt = sub.add_parser(
        "plot",
        usage="reroll plot [-h] [--out FILE.png|DIR] RUN_DIR [RUN_DIR ...] [METRIC ...]",
        help="draw runs' metrics per step into a PNG (default: reward, accuracy, KL, step time)",
    )
    pt.add_argument(
        "runs_and_metrics",
        nargs="+",
        metavar="RUN_DIR|METRIC",
        help="run directories (one line each), then metric names or patterns: eval/accuracy 'timing/*'",
    )
    pt.add_argument(
        "--out", type=Path, help="a .png file, or a directory for curves.png (default: <first run>/plots)"
    )
    pt.set_defaults(func=cmd_plot)

    s = sub.add_parser(
        "serve", help="serve the policy (or a checkpoint) as an OpenAI-compatible completions endpoint"
    )
    s.add_argument("config", type=Path)
    s.add_argument("overrides", **overrides)
    s.add_argument(
        "--checkpoint", type=Path, help="a checkpoint, its model/ directory, or a run directory (its latest)"
    )
    s.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    s.add_argument(
        "--port", type=int, default=8000, help="port to listen on; 0 picks a free one (default 8000)"
    )
    s.add_argument(
        "--tool-parser",
        choices=["hermes", "llama3"],
        help="how the model writes tool calls (default: the format its chat template shows)",
    )
    s.add_argument(
        "--api-key", help="requests must carry 'Authorization: Bearer KEY' (or set REROLL_API_KEY)"
    )
    s.add_argument("--verbose", action="store_true", default=argparse.SUPPRESS, help=VERBOSE_HELP)
    s.set_defaults(func=cmd_serve)

    v = sub.add_parser(
        "validate",
        help="check a config, its data files, rewards, output directory and lengths without running it",
    )
    v.add_argument("config", type=Path)
    v.add_argument("overrides", **overrides)
    v.set_defaults(func=cmd_validate)

    pl = sub.add_parser(
        "plan", help="print where roles go on N GPUs and their memory; refuse what cannot fit"
    )
    pl.add_argument("config", type=Path)
    pl.add_argument("overrides", **overrides)
    pl.add_argument("--gpus", type=int, required=True, help="GPUs available")
    pl.add_argument("--gpu-memory", type=float, default=80.0, help="GiB per GPU")
    pl.add_argument("--prompt-tokens", type=int, default=512, help="assumed prompt length")
    pl.set_defaults(func=cmd_plan)

    from reroll.config.alphabet import ALPHABET_NAMES

    m = sub.add_parser("make-tiny-model", help="build a small random Qwen2 model and tokenizer offline")
    m.add_argument("out", type=Path)
    m.add_argument(
        "--alphabet",
        default="arithmetic",
        metavar="NAME|CHARS",
        help=f"the tokenizer's characters: a name ({', '.join(ALPHABET_NAMES)}) or the characters themselves, "
        "e.g. '0123456789+-=abc ' (ASCII; letters only are read as a name, write chars:abc for those; "
        "characters starting with '-' as --alphabet='-+0123'). Default: arithmetic",
    )
    m.add_argument("--hidden-size", type=int, default=128)
    m.add_argument("--num-layers", type=int, default=2)
    m.add_argument("--num-heads", type=int, default=4)
    m.add_argument("--seed", type=int, default=0)
    m.set_defaults(func=cmd_make_tiny_model)

    d = sub.add_parser("make-data", help="write the synthetic arithmetic task as train/test JSONL")
    d.add_argument("out", type=Path)
    d.add_argument("--n-train", type=int, default=5000)
    d.add_argument("--n-test", type=int, default=500)
    d.add_argument("--max-operand", type=int, default=99)
    d.add_argument("--ops", default="+")
    d.add_argument("--seed", type=int, default=0)
    d.set_defaults(func=cmd_make_data)

    e = sub.add_parser("env-check", help="play an environment with a random or scripted policy (no model)")
    e.add_argument("name", nargs="?", help="registered name, 'gem:<id>' or 'package.module:Factory'")
    e.add_argument("options", nargs="*", default=[], help="environment options: size=6 num_boxes=2")
    e.add_argument("--policy", choices=["random", "scripted"], default="random")
    e.add_argument("--episodes", type=int, default=20)
    e.add_argument("--seed", type=int, default=0)
    e.add_argument("--show-turns", type=int, default=3, help="turns of the first episode to print")
    e.add_argument("--list", action="store_true", help="list the registered environments")
    e.set_defaults(func=cmd_env_check)

    c = sub.add_parser("config-docs", help="print every config key with its type, default and meaning")
    c.set_defaults(func=cmd_config_docs)
    return p


def _import_from_cwd() -> None:
    """Put the current directory on the import path, as ``python -m reroll.cli`` does and as Ray does
    for its workers, so a ``reward.fn: my_rewards:score`` beside the config imports the same way in
    ``reroll validate`` (the installed script's ``sys.path`` starts at its own directory)."""
    cwd = os.getcwd()
    if not any(p in ("", ".", cwd) for p in sys.path):
        sys.path.insert(0, cwd)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    # overrides may follow a flag (`train c.yaml --resume a=1`): argparse leaves those over
    if extra and hasattr(args, "overrides") and all("=" in e and not e.startswith("-") for e in extra):
        args.overrides += extra
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    _setup_logging(args.debug, args.verbose)
    _import_from_cwd()
    _terminated.clear()
    if args.command in ("train", "generate", "serve"):
        signal.signal(signal.SIGTERM, _terminate)  # `kill` stops a run as Ctrl-C does, workers shut down
    try:
        code = args.func(args)
        sys.stdout.flush()  # here, where a closed pipe is caught, not at the interpreter's exit
        return code
    except BrokenPipeError:  # `reroll config-docs | head`: the reader left; nothing to report
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # the interpreter's last flush goes nowhere
        return 141  # 128 + SIGPIPE, as a program the pipe stopped
    except UserError as e:
        if args.debug:
            raise
        print(f"error: {e}", file=sys.stderr)
        return 2
    except RoleError as e:
        if args.debug:
            raise
        print(f"error: {e}\n(run with --debug for the traceback)", file=sys.stderr)
        return 1
    except KeyboardInterrupt as e:
        if args.command == "serve":
            return 0
        print(_interrupted(args), file=sys.stderr)
        return 143 if isinstance(e, Terminated) or _terminated else 130


if __name__ == "__main__":
    sys.exit(main())
