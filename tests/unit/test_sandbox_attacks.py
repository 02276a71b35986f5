"""The sandbox against the attacks of issue 17, with the audit hook switched off (issue 41's, on the
host's disk, memory and the kernel's system calls, are in ``test_sandbox_attacks_host.py`` and
``test_sandbox_attacks_seccomp.py``).

Each program first disables the audit hook from pure Python (it walks the frames to the hook and
replaces its code, as an attacker would), proves it did by importing ``ctypes``, which the hook
refuses, and prints the sandbox's hostname and its uid (``sandbox_attack.attack`` checks both
before anything else). What stops the attack after that is the kernel: namespaces, an unprivileged
uid, read-only mounts, rlimits. Each test then checks that the outside effect did not happen (file
absent, process gone, worker alive), and that the program's clean part still printed the right
answer.

Everything machine-wide is this test's own: paths under ``tmp_path`` or with a fresh uuid, servers
on port 0, process markers with a uuid, cgroups by this process's pid. Two suites on one machine
do not see each other's state.
"""

from __future__ import annotations

import os
import signal
import socket
import sysconfig
import tempfile
import textwrap
import threading
import time
import uuid
from pathlib import Path

import pytest
from sandbox_attack import HOOK_OFF, assert_ran_inside, attack, host_pids_with

from reroll.envs.tools import PythonTool
from reroll.rewards import bwrap
from reroll.rewards import sandbox as sb
from reroll.rewards.bwrap import NOBODY
from reroll.rewards.cgroups import cgroup_bases
from reroll.rewards.code import code_tests
from reroll.rewards.sandbox import Limits, SandboxResult, SandboxUnavailable, run_python

pytestmark = pytest.mark.skipif(
    sb.bubblewrap_problem() is not None, reason=f"no bubblewrap sandbox here: {sb.bubblewrap_problem()}"
)

SITE = Path(sysconfig.get_paths()["purelib"])  # the Python installation's site-packages: a .pth there runs


@pytest.fixture
def outside():
    """Paths in the real Python installation for a test to target; removed afterwards if it failed."""
    tag = f"reroll-attack-{uuid.uuid4().hex[:12]}"
    paths = {name: SITE / f"{tag}-{name}" for name in ("link", "symlink", "rename", "pth", "db", "fifo")}
    paths["pth"] = SITE / f"{tag}.pth"
    yield paths
    for p in paths.values():
        if p.exists() or p.is_symlink():
            p.unlink()


def test_the_program_is_nobody_without_capabilities_in_its_own_namespaces():
    """Inside: uid/gid 65534, no capabilities, no_new_privs, other namespaces than the worker's.
    Outside (read by the worker from the host's /proc): the same uid, not root."""
    names = ("user", "mnt", "pid", "net", "ipc", "uts")
    marker = f"reroll-attack-{uuid.uuid4().hex}"
    code = f"""
    status = dict(line.split(":", 1) for line in open("/proc/self/status"))
    for key in ("Uid", "Gid", "CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb", "NoNewPrivs"):
        print(key, status[key].split(), file=sys.stderr)
    for ns in {names!r}:
        print("ns", ns, os.readlink(f"/proc/self/ns/{{ns}}"), file=sys.stderr)
    attempt("write core_pattern", os.open, "/proc/sys/kernel/core_pattern", os.O_WRONLY)
    sys.stderr.flush()
    os.execv(sys.executable, [sys.executable, "-c", "import time; time.sleep(20)", {marker!r}])
    """
    done: list[SandboxResult] = []
    runner = threading.Thread(target=lambda: done.append(run_python(HOOK_OFF + textwrap.dedent(code))))
    runner.start()
    deadline, pids = time.monotonic() + 10, []
    while not pids and time.monotonic() < deadline:
        pids = host_pids_with(marker)
        time.sleep(0.02)
    host = dict(line.split(":", 1) for line in Path(f"/proc/{pids[0]}/status").read_text().splitlines())
    os.kill(pids[0], signal.SIGKILL)
    runner.join()
    assert_ran_inside(done[0])
    err = done[0].stderr
    assert (
        "Uid ['65534', '65534', '65534', '65534']" in err
        and "Gid ['65534', '65534', '65534', '65534']" in err
    )
    for cap in ("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb"):
        assert f"{cap} ['0000000000000000']" in err
    assert "NoNewPrivs ['1']" in err
    for ns in names:  # every namespace differs from the worker's
        assert f"ns {ns} {os.readlink(f'/proc/self/ns/{ns}')}" not in err
    assert "write core_pattern -> PermissionError" in err
    want_uid = str(NOBODY) if os.geteuid() == 0 else str(os.geteuid())  # a user's bwrap maps to itself
    assert host["Uid"].split() == [want_uid] * 4 and host["CapEff"].split() == ["0000000000000000"]
    assert host["NoNewPrivs"].strip() == "1"


def test_frame_tampering_then_writing_outside(tmp_path):
    target = tmp_path / "pwned.txt"
    r = attack(f"""
    os.makedirs({str(tmp_path)!r}, exist_ok=True)  # the path exists only in the sandbox's own /tmp
    attempt("write", lambda: open({str(target)!r}, "w").write("pwned"))
    attempt("write /root", lambda: open("/root/pwned", "w").write("pwned"))
    """)
    assert "write -> 5" in r.stderr  # it "worked" inside: the write landed in the run's tmpfs
    assert "write /root -> " in r.stderr and "write /root -> 5" not in r.stderr
    assert not target.exists() and r.stdout == "7\n"


def test_ctypes_cannot_change_uid_mounts_or_namespaces(outside):
    r = attack(f"""
    libc = ctypes.CDLL(None, use_errno=True)
    def call(name, *args):
        rc = getattr(libc, name)(*args)
        print(name, rc, os.strerror(ctypes.get_errno()) if rc < 0 else "", file=sys.stderr)
    call("setuid", 0)
    call("unshare", 0x10000000)  # CLONE_NEWUSER: would make it root in a new namespace
    call("mount", b"none", {str(SITE).encode()!r}, b"tmpfs", 0, None)
    attempt("open init's mnt ns", os.open, "/proc/1/ns/mnt", os.O_RDONLY)  # bwrap's init, not the host's
    call("setns", os.open("/proc/self/ns/mnt", os.O_RDONLY), 0)  # even its own: needs CAP_SYS_ADMIN
    call("open", {str(outside["pth"]).encode()!r}, os.O_WRONLY | os.O_CREAT, 0o644)
    """)
    for name in ("setuid", "unshare", "mount", "setns", "open"):
        assert f"\n{name} -1 " in r.stderr, r.stderr
    # the seccomp filter refuses first; below it, bwrap --disable-userns leaves no user namespace to make
    refused = "No space left on device" if bwrap.seccomp_problem() else "Operation not permitted"
    assert f"unshare -1 {refused}" in r.stderr
    assert not outside["pth"].exists() and r.stdout == "7\n"


def test_link_rename_symlink_cannot_create_files_outside(outside):
    r = attack(f"""
    open("/tmp/mine", "w").write("x")
    attempt("link", os.link, "/sandbox/main.py", {str(outside["link"])!r})
    attempt("symlink", os.symlink, "/sandbox/main.py", {str(outside["symlink"])!r})
    attempt("rename", os.rename, "/tmp/mine", {str(outside["rename"])!r})
    """)
    for name in ("link", "symlink", "rename"):
        assert f"{name} -> OSError" in r.stderr  # read-only file system / cross-device
        assert not (outside[name].exists() or outside[name].is_symlink())
    assert r.stdout == "7\n"


def test_os_open_cannot_write_into_the_python_installation(outside):
    r = attack(f"""
    def write(path):
        fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
        os.write(fd, b"# a .pth here would run at every interpreter start\\n")
    attempt("pth", write, {str(outside["pth"])!r})
    attempt("stdlib", write, os.path.join(os.path.dirname(os.__file__), "reroll-attack.py"))
    """)
    assert "pth -> OSError" in r.stderr and "Read-only file system" in r.stderr
    assert not outside["pth"].exists() and not (Path(os.__file__).parent / "reroll-attack.py").exists()
    assert r.stdout == "7\n"


def test_sqlite_and_fifo_cannot_create_files_outside(outside):
    r = attack(f"""
    import sqlite3
    attempt("sqlite", lambda: sqlite3.connect({str(outside["db"])!r}).execute("create table t (x)"))
    attempt("fifo", os.mkfifo, {str(outside["fifo"])!r})
    """)
    assert "sqlite -> OperationalError" in r.stderr and "fifo -> OSError" in r.stderr
    assert not outside["db"].exists() and not outside["fifo"].exists()
    assert r.stdout == "7\n"


def test_killing_the_worker_fails_and_the_run_is_cleaned_up(tmp_path, monkeypatch):
    """The worker's pid is not in the sandbox's pid namespace; killing what is there ends only the run."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # the run's host directory goes here
    worker = os.getpid()
    r = attack(f"""
    print(7, flush=True)  # the answer first: the run is about to kill itself
    attempt("kill worker", os.kill, {worker}, signal.SIGKILL)
    attempt("pidfd worker", os.pidfd_open, {worker})
    attempt("kill parent", os.kill, os.getppid(), signal.SIGKILL)
    attempt("kill init", os.kill, 1, signal.SIGKILL)
    sys.stderr.flush()
    os.kill(-1, signal.SIGKILL)  # every process it may signal: its own sandbox's
    """)
    assert (
        "kill worker -> ProcessLookupError" in r.stderr and "pidfd worker -> ProcessLookupError" in r.stderr
    )
    assert r.stdout.startswith("7")
    assert os.getpid() == worker and list(tmp_path.iterdir()) == []  # alive, and the run dir is gone
    for base in cgroup_bases().values():
        assert not [p for p in base.iterdir() if p.name.startswith(f"reroll-sandbox-{worker}-")]


@pytest.mark.parametrize("ends", ["exits", "times_out"])
def test_setsid_double_fork_leaves_no_process(ends):
    marker = f"reroll-attack-{uuid.uuid4().hex}"
    r = attack(
        f"""
    child = os.fork()
    if child == 0:
        os.setsid()
        if os.fork() == 0:
            os.execv(sys.executable, [sys.executable, "-c", "import time; time.sleep(60)", {marker!r}])
        os._exit(0)
    os.waitpid(child, 0)
    while not any({marker!r}.encode() in open(f"/proc/{{p}}/cmdline", "rb").read()
                  for p in os.listdir("/proc") if p.isdigit()):
        pass
    print("survivor running", file=sys.stderr, flush=True)
    {"import time; time.sleep(60)" if ends == "times_out" else ""}
    """,
        Limits(cpu_s=2, wall_s=3.0, memory_mb=256),
    )
    assert "survivor running" in r.stderr
    assert r.status == ("timeout" if ends == "times_out" else "ok")
    assert host_pids_with(marker) == []


def test_namespace_reentry_fails_and_the_host_network_stays_unreachable():
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        server.setblocking(False)
        port, worker = server.getsockname()[1], os.getpid()
        r = attack(f"""
        attempt("worker ns", os.open, "/proc/{worker}/ns/net", os.O_RDONLY)
        attempt("init ns", os.open, "/proc/1/ns/net", os.O_RDONLY)
        libc = ctypes.CDLL(None, use_errno=True)
        print("setns", libc.setns(os.open("/proc/self/ns/net", os.O_RDONLY), 0), file=sys.stderr)
        attempt("nsenter", os.execv, "/usr/bin/nsenter", ["nsenter", "-t", "1", "-n", "true"])
        attempt("connect", socket.create_connection, ("127.0.0.1", {port}), 2)
        print("interfaces", [name for _, name in socket.if_nameindex()], file=sys.stderr)
        """)
        with pytest.raises(BlockingIOError):
            server.accept()  # nothing connected
    assert "worker ns -> FileNotFoundError" in r.stderr and "setns -1" in r.stderr
    assert "nsenter -> FileNotFoundError" in r.stderr  # and were it there, setns above is what it calls
    assert "connect -> ConnectionRefusedError" in r.stderr  # its own loopback, where nothing listens
    assert "interfaces ['lo']" in r.stderr and r.stdout == "7\n"


def test_the_worker_environment_is_not_visible(monkeypatch):
    secret = f"token-{uuid.uuid4().hex}"
    monkeypatch.setenv("REROLL_ATTACK_SECRET", secret)
    r = attack(f"""
    print(dict(os.environ), file=sys.stderr)
    attempt("worker environ", lambda: open("/proc/{os.getpid()}/environ", "rb").read())
    for pid in [p for p in os.listdir("/proc") if p.isdigit()]:
        attempt(f"environ {{pid}}", lambda: open(f"/proc/{{pid}}/environ", "rb").read())
    """)
    assert "worker environ -> FileNotFoundError" in r.stderr and "environ 1 -> " in r.stderr
    assert secret not in r.stderr and secret not in r.stdout and r.stdout == "7\n"


def test_filling_the_disk_stops_at_the_tmpfs_bound():
    """1 GB to /tmp in 512 KB files: the run's tmpfs (memory, not the host disk) is full at 16 MB."""
    r = attack(
        """
    st = os.statvfs("/tmp")
    print("tmp size", st.f_blocks * st.f_frsize, file=sys.stderr)
    print("tmp type", [l.split()[-3] for l in open("/proc/self/mountinfo") if l.split()[4] == "/tmp"],
          file=sys.stderr)
    written = 0
    try:
        for i in range(2048):
            with open(f"/tmp/fill-{i}", "wb") as f:
                f.write(b"x" * (512 << 10))
            written += 512 << 10
    except OSError as e:
        print("stopped", e.strerror, file=sys.stderr)
    print("written", written, file=sys.stderr)
    """,
        Limits(cpu_s=5, wall_s=10.0, memory_mb=256, tmp_mb=16),
    )
    assert f"tmp size {16 << 20}" in r.stderr and "tmp type ['tmpfs']" in r.stderr
    assert "stopped No space left on device" in r.stderr
    written = int(r.stderr.split("written ")[1].split()[0])
    assert 8 << 20 <= written <= 16 << 20 and r.stdout == "7\n"
    one_file = attack(
        "with open('/tmp/big', 'wb') as f:\n    for _ in range(1024):\n        f.write(b'x' * (1 << 20))"
    )
    assert "File too large" in one_file.stderr  # RLIMIT_FSIZE: no file past max_output_bytes


def test_fork_bomb_is_bounded_by_the_kernel():
    r = attack(
        """
    n = 0
    try:
        for _ in range(1000):
            if os.fork() == 0:
                import time; time.sleep(30); os._exit(0)
            n += 1
    except OSError as e:
        print("refused", type(e).__name__, file=sys.stderr)
    print("forked", n, file=sys.stderr)
    """,
        Limits(cpu_s=2, wall_s=10.0, memory_mb=256, max_processes=8),
    )
    assert "refused BlockingIOError" in r.stderr and "forked 7" in r.stderr  # 8 tasks: itself and 7
    assert r.stdout == "7\n"


@pytest.mark.skipif("memory" not in cgroup_bases(), reason="no memory cgroup can be made here")
def test_memory_of_all_processes_is_bounded_by_the_cgroup():
    """Four processes of 100 MB each, every one under RLIMIT_AS (128 MB): together past the run's
    memory cgroup (128 + 16 + 64 MB), so the kernel kills some; the run reports ``memory``."""
    r = attack(
        """
    kids = []
    for _ in range(4):
        pid = os.fork()
        if pid == 0:
            b = bytearray(100 << 20)
            import time; time.sleep(0.5); os._exit(0)
        kids.append(pid)
    print("exits", sorted(os.waitstatus_to_exitcode(os.waitpid(k, 0)[1]) for k in kids), file=sys.stderr)
    """,
        Limits(cpu_s=5, wall_s=10.0, memory_mb=128, tmp_mb=16),
    )
    assert r.status == "memory" and f"exits [-{signal.SIGKILL}, " in r.stderr and r.stdout == "7\n"


def test_network_is_unreachable():
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        server.setblocking(False)
        r = attack(
            f"""attempt("connect", socket.create_connection, ("127.0.0.1", {server.getsockname()[1]}), 2)"""
        )
        with pytest.raises(BlockingIOError):
            server.accept()
    assert "connect -> ConnectionRefusedError" in r.stderr and r.stdout == "7\n"  # the sandbox's own loopback


def test_a_clean_program_still_scores():
    sample = {"tests": [{"stdin": "3 4\n", "stdout": "7\n"}, {"call": "add(2, 3)", "expected": 5}]}
    program = "def add(a, b):\n    return a + b\n\nif __name__ == '__main__':\n    print(add(*map(int, input().split())))"
    r = code_tests("", f"```python\n{program}\n```", sample)
    assert (r.score, r.details["errors"]) == (1.0, 0)


def test_without_bubblewrap_the_error_names_the_fix_and_audit_hook_is_opt_in(monkeypatch, caplog):
    real_which = sb.shutil.which
    monkeypatch.setattr(sb.shutil, "which", lambda name: None if name == "bwrap" else real_which(name))
    bwrap._probe.cache_clear()
    try:
        with pytest.raises(SandboxUnavailable, match="apt-get install bubblewrap"):
            run_python("print(1)")
        with pytest.raises(SandboxUnavailable, match="sandbox: audit_hook"):
            PythonTool()  # at construction, not on every call
        sb._warn_audit_hook.cache_clear()
        with caplog.at_level("WARNING", logger=sb.__name__):
            assert run_python("print(1)", sandbox="audit_hook").stdout == "1\n"
            assert PythonTool(sandbox="audit_hook")(code="print(2)") == "2"
        assert [r.message for r in caplog.records].count(caplog.records[0].message) == 1  # once
        assert "without an OS-level sandbox" in caplog.records[0].message
    finally:
        monkeypatch.undo()
        bwrap._probe.cache_clear()
