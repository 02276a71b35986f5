"""code_tests and its sandbox: passing, failing and hostile programs, each contained and scored.

These run in the default sandbox (bubblewrap) with its audit hook on; ``test_sandbox_attacks.py``
switches the hook off and checks the kernel layer. Nothing here uses a fixed path or cgroup name:
secrets live in ``tmp_path`` and cgroups are checked by this process's own prefix."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time

import pytest

from reroll.rewards.cgroups import cgroup_bases
from reroll.rewards.code import code_tests, extract_program
from reroll.rewards.sandbox import Limits, bubblewrap_problem, network_isolation, run_python

pytestmark = pytest.mark.skipif(
    bubblewrap_problem() is not None, reason=f"no bubblewrap sandbox here: {bubblewrap_problem()}"
)

ADD_IO = {"tests": [{"stdin": "3 4\n", "stdout": "7\n"}, {"stdin": "-1 1\n", "stdout": "0\n"}]}
FAST = {"cpu_s": 1, "wall_s": 5.0, "memory_mb": 256}


def fenced(program: str) -> str:
    return f"Here is my solution.\n```python\n{program}\n```\n"


def test_passing_program_scores_one():
    r = code_tests("", fenced("a, b = map(int, input().split())\nprint(a + b)"), ADD_IO)
    assert (r.score, r.details["correct"], r.details["errors"]) == (1.0, 1, 0)


def test_partial_credit_and_all_or_nothing():
    program = fenced("a, b = map(int, input().split())\nprint(a + b if a > 0 else 99)")
    assert code_tests("", program, ADD_IO).score == 0.5
    assert code_tests("", program, ADD_IO, all_or_nothing=True).score == 0.0


def test_function_call_style():
    sample = {
        "tests": [
            {"call": "add(2, 3)", "expected": 5},
            {"call": "add([1], [2])", "expected": [1, 2]},
            {"call": "add(1)", "expected": 1},  # raises TypeError: failed, not a crash of the run
        ]
    }
    program = fenced("def add(a, b):\n    return a + b\n\nif __name__ == '__main__':\n    input()")
    r = code_tests("", program, sample)
    assert r.score == pytest.approx(2 / 3)


def test_no_code_block_scores_zero_without_running():
    r = code_tests("", "print(7)", ADD_IO)
    assert (r.score, r.details["no_code"]) == (0.0, 1)
    assert extract_program("```python\nx=1\n```\nthen\n```python\nx=2\n```") == "x=2\n"


def test_infinite_loop_is_stopped_by_the_cpu_limit():
    start = time.monotonic()
    r = code_tests("", fenced("while True:\n    pass"), ADD_IO, **FAST)
    assert (r.score, r.details["timeouts"]) == (0.0, 2)
    assert time.monotonic() - start < 2 * FAST["wall_s"]


def test_sleeping_program_is_stopped_by_the_wall_limit():
    r = run_python("import time\ntime.sleep(60)", limits=Limits(cpu_s=5, wall_s=1.0))
    assert r.status == "timeout" and r.wall_s < 5


def test_ten_gigabytes_is_refused():
    r = run_python("x = bytearray(10 * 1024**3)\nprint('allocated')", limits=Limits(memory_mb=256))
    assert r.status == "memory" and "allocated" not in r.stdout


def test_fork_bomb_is_refused():
    r = run_python("import os\nwhile True:\n    os.fork()")
    assert r.status == "error" and "os.fork is not allowed" in r.stderr
    r = run_python("import subprocess\nsubprocess.run(['ls', '/'])")
    assert r.status == "error" and "subprocess.Popen is not allowed" in r.stderr


def test_host_files_are_unreadable(tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("top secret")
    r = run_python(f"print(open({str(secret)!r}).read())")  # the host's /tmp is not the sandbox's /tmp
    assert r.status == "error" and "No such file" in r.stderr and "top secret" not in r.stdout
    r = run_python("print(open('/root/.bashrc').read())")
    assert r.status == "error" and "outside the sandbox" in r.stderr
    r = run_python("import os\nprint(os.listdir('/etc'))")
    assert "outside the sandbox" in r.stderr
    r = run_python("import os\nprint(os.path.expanduser('~'))\nopen('f.txt', 'w').write('ok')")
    assert (r.status, r.stdout) == ("ok", "/tmp\n")  # HOME and the working directory: the run's own tmpfs


def test_sockets_are_refused():
    r = run_python("import socket\nsocket.create_connection(('127.0.0.1', 80), timeout=1)")
    assert r.status == "error" and "not allowed" in r.stderr


def test_network_namespace_where_available():
    """Below the audit hook, the kernel layer: a server on this host's loopback is unreachable."""
    prefix = network_isolation()
    if not prefix:
        pytest.skip("unshare -n is not available here: only the audit hook blocks sockets")
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        probe = f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2)\nprint('reached')"
        outside = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=30)
        inside = subprocess.run(
            [*prefix, sys.executable, "-c", probe], capture_output=True, text=True, timeout=30
        )
    assert "reached" in outside.stdout and "reached" not in inside.stdout


def test_output_is_capped():
    r = run_python("while True:\n    print('x' * 1000)", limits=Limits(max_output_bytes=10_000))
    assert r.status == "output_limit" and len(r.stdout) <= 10_000


def test_run_directory_is_removed(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # the host-side run directory goes here
    r = run_python("open('f.txt', 'w').write('x' * 1000)\nprint('ok')")
    assert r.stdout == "ok\n" and list(tmp_path.iterdir()) == []


ADD = "a, b = map(int, input().split())\nprint(a + b)"
ESCAPE = (  # _posixsubprocess.fork_exec starts a process without an audit event; the sandbox removes it
    "import _posixsubprocess, os\nr, w = os.pipe()\n_posixsubprocess.fork_exec([b'/bin/true'], [b'/bin/true'], "
    "True, (w,), None, None, -1, -1, -1, -1, -1, -1, r, w, True, False, -1, None, None, None, -1, None, False)"
)


@pytest.mark.parametrize(
    "hostile, count, reason",
    [
        ("x = bytearray(10 * 1024**3)", "memory", "MemoryError"),
        ("import os\nos.fork()", "errors", "os.fork is not allowed"),
        ("import subprocess\nsubprocess.run(['true'])", "errors", "subprocess.Popen is not allowed"),
        (ESCAPE, "errors", "has no attribute 'fork_exec'"),
        (
            "import sys\nsys.modules.pop('_posixsubprocess')\nimport _posixsubprocess",
            "errors",
            "importing _posix",
        ),
        ("print(open({secret!r}).read())", "errors", "No such file"),  # not in the sandbox's /tmp
        (
            "import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=1)",
            "errors",
            "not allowed",
        ),
    ],
    ids=["10GB", "fork", "subprocess", "fork_exec", "reimport", "host_file", "socket"],
)
def test_hostile_program_that_would_pass_scores_zero_with_its_reason(tmp_path, hostile, count, reason):
    """Each program does something hostile, then prints the right answer: only containment makes it fail."""
    secret = tmp_path / "secret.txt"
    secret.write_text("top secret")
    with socket.socket() as server:  # something to connect to, were the connection allowed
        server.bind(("127.0.0.1", 0))
        server.listen()
        program = hostile.format(secret=str(secret), port=server.getsockname()[1]) + "\n" + ADD
        r = code_tests("", fenced(program), {"tests": ADD_IO["tests"][:1]}, **FAST)
        run = run_python(program, "3 4\n", limits=Limits(cpu_s=1, wall_s=5.0, memory_mb=256))
    assert (r.score, r.details[count]) == (0.0, 1)  # the test case failed, for this reason
    assert reason in run.stderr and run.stdout == ""  # (without the hostile line it passes: first test)


def test_task_limit_is_enforced_by_the_kernel():
    """Threads are tasks too, and start without any audit event: RLIMIT_NPROC in the run's own user
    namespace (and its pids cgroup, where reroll may make one) stops them."""
    program = (
        "import threading, time\nthreading.stack_size(65536)\nn = 0\ntry:\n"
        "    for _ in range(500):\n"
        "        threading.Thread(target=time.sleep, args=(5,), daemon=True).start()\n        n += 1\n"
        "except RuntimeError as e:\n    print('refused:', e)\nprint(n)"
    )
    r = run_python(program, limits=Limits(max_processes=16, wall_s=10.0))
    assert "refused: can't start new thread" in r.stdout
    assert int(r.stdout.split()[-1]) == 15  # 16 tasks: the main thread and 15 more
    for base in cgroup_bases().values():  # only this process's: another suite may be running
        assert not [p for p in base.iterdir() if p.name.startswith(f"reroll-sandbox-{os.getpid()}-")]


def test_limits_name_each_bad_value_at_once():
    with pytest.raises(ValueError) as e:
        Limits(memory_mb=0, wall_s=-1.0)
    assert "wall_s=-1.0" in str(e.value) and "memory_mb=0" in str(e.value) and "> 0" in str(e.value)
