"""Reward throughput on CPU: samples/s for each built-in reward, in one thread and through a reward
worker, with each call on the worker's threads (``isolation: thread``, the default for registered
rewards) and in its child processes (``isolation: process``, the default for ``module:function``).

    python benchmarks/rewards.py [--n 64] [--threads 4] [--only code_tests]

The judge is timed against a stub server on 127.0.0.1 (so it measures reroll's overhead, not a
model); the reward model is a tiny random Qwen2 classifier. Prints a Markdown table and the hardware.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from reroll.config.reward import RewardConfig
from reroll.data.types import RewardItem
from reroll.rewards import resolve_reward
from reroll.roles.reward import RewardWorker

CODE = "```python\na, b = map(int, input().split())\nprint(a + b)\n```"
CASES = {
    "exact_match": ("46", {"answer": "46"}, {}),
    "numeric_match": ("The answer is 46.", {"answer": "46"}, {}),
    "math_verify": ("<think>add</think> so \\boxed{\\frac{1}{2}}", {"answer": "0.5"}, {}),
    "ifeval": (
        "all lowercase, three bullets:\n* a\n* b\n* c",
        {
            "constraints": [
                {"type": "lowercase"},
                {"type": "bullets", "value": 3},
                {"type": "max_words", "value": 20},
            ]
        },
        {},
    ),
    "code_tests (2 io tests)": (
        CODE,
        {"tests": [{"stdin": "1 2\n", "stdout": "3\n"}, {"stdin": "5 5\n", "stdout": "10\n"}]},
        {},
    ),
    # the same programs without the OS sandbox: what bubblewrap's namespaces cost per program
    "code_tests (2 io tests), sandbox audit_hook": (
        CODE,
        {"tests": [{"stdin": "1 2\n", "stdout": "3\n"}, {"stdin": "5 5\n", "stdout": "10\n"}]},
        {"sandbox": "audit_hook"},
    ),
}


def _stub_judge() -> str:
    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):
            self.rfile.read(int(self.headers["Content-Length"]))
            data = json.dumps({"choices": [{"message": {"content": "Fine.\nScore: 7"}}]}).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return f"http://127.0.0.1:{server.server_address[1]}/v1"


def _tiny_reward_model(path: str) -> None:
    from reroll.models.tiny import build_tiny_reward_model

    build_tiny_reward_model(path, hidden_size=64, num_layers=2)


def _rate(score_all, n: int) -> float:
    start = time.perf_counter()
    score_all()
    return n / (time.perf_counter() - start)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--n", type=int, default=64, help="samples per reward")
    p.add_argument("--threads", type=int, default=4, help="reward.threads of the worker")
    p.add_argument("--torch-threads", type=int, default=1, help="torch intra-op threads (the reward model)")
    p.add_argument("--only", default="", help="time only the rewards whose label contains this")
    args = p.parse_args()
    import torch

    torch.set_num_threads(args.torch_threads)
    tmp = tempfile.mkdtemp()
    cases = dict(CASES)
    cases["llm_judge (stub server)"] = ("4", {}, {"url": _stub_judge()})
    cases["reward_model (tiny Qwen2, 2 layers)"] = ("12+34=46", {}, {"path": f"{tmp}/rm"})
    cases = {label: case for label, case in cases.items() if args.only in label}
    if any(label.startswith("reward_model") for label in cases):
        _tiny_reward_model(f"{tmp}/rm")

    print(f"hardware: {platform.processor() or platform.machine()}, {os.cpu_count()} CPU cores, "
          f"{platform.system()} {platform.release()}, Python {platform.python_version()}")  # fmt: skip
    print(
        f"{args.n} samples per reward; worker = RewardWorker with reward.threads={args.threads}; "
        f"torch threads {args.torch_threads}\n"
    )
    print(
        "| reward | samples/s (1 thread, direct) | samples/s (worker, thread) | samples/s (worker, process) |"
    )
    print("|---|---|---|---|")
    for label, (response, row, fn_args) in cases.items():
        name = label.split(" ")[0]
        fn = resolve_reward(name, fn_args)
        items = [("prompt", response, row)] * args.n
        fn(*items[0])  # warm up: imports, model load
        direct = _rate(lambda fn=fn, items=items: [fn(*it) for it in items], args.n)
        tagged = [RewardItem(*it, "d") for it in items]
        rates = []
        for isolation in ("thread", "process"):
            term = {"fn": name, "args": fn_args, "isolation": isolation}
            cfg = RewardConfig(domains={"d": {"rewards": [term]}}, threads=args.threads, sample_timeout_s=600)
            worker = RewardWorker(0, cfg)
            worker.score(tagged[: args.threads])  # warm up each thread / process
            rates.append(_rate(lambda worker=worker, tagged=tagged: worker.score(tagged), args.n))
            worker.close()
        print(f"| {label} | {direct:,.1f} | {rates[0]:,.1f} | {rates[1]:,.1f} |")


if __name__ == "__main__":
    main()
