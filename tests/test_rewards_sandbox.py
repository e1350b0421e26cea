"""Hostile code in the sandbox: nothing scores as a pass, nothing harms the host (docs/rewards.md, "Code: the
sandbox and its threat model")."""

import os
import socket
import tempfile
import time

import pytest

from posttrain.rewards.sandbox import IS_ROOT, Limits, Sandbox, _procs_of_uid

pytestmark = pytest.mark.timeout(60)

# a short wall limit keeps the loops/sleeps cheap
SB = Sandbox(Limits(wall_s=2.0, cpu_s=2, memory_mb=512, nproc=16, output_bytes=4096))
TESTS = ["assert add(1, 2) == 3", "assert add(-1, 1) == 0", "assert add(10, 5) == 15"]
MARK = os.path.join(tempfile.gettempdir(), f"posttrain_sbx_marker_{os.getpid()}")
SECRET = "posttrain-test-secret-4f1c"

HOSTILE = {
    "infinite_loop": "def add(a, b):\n    while True: pass",
    "infinite_loop_at_import": "while True: pass",
    "sleep_past_limit": "import time\ntime.sleep(30)\ndef add(a, b): return a + b",
    "fork_bomb": "import os\nwhile True:\n    try: os.fork()\n    except Exception: pass",
    "subprocess_bomb": "import subprocess\nwhile True:\n    try: subprocess.Popen(['sleep', '100'])\n    except Exception: pass",
    "memory_hog": "x = []\nwhile True: x.append(bytearray(50 * 1024 * 1024))",
    "huge_output": "import sys\nwhile True: sys.stdout.write('x' * 65536)",
    "network": "import socket\ns = socket.create_connection(('1.1.1.1', 80), timeout=1)\ndef add(a, b): return a + b",
    "write_outside_workdir": f"open({MARK!r}, 'w').write('pwned')\ndef add(a, b): return a + b",
    "os_exit_before_asserts": "import os\nos._exit(0)",
    "sys_exit_before_asserts": "import sys\nsys.exit(0)",
    "exit_in_function": "def add(a, b):\n    import os; os._exit(0)",
    "sys_exit_in_function": "def add(a, b):\n    raise SystemExit(0)",
    "patch_assertionerror": "import builtins\nclass E(Exception): pass\nbuiltins.AssertionError = E\ndef add(a, b): return 7",
    "replace_builtins": "import builtins\nbuiltins.len = lambda x: 3\nbuiltins.print = lambda *a, **k: None\ndef add(a, b): return None",
    "always_equal": "class A:\n    def __eq__(self, o): return True\n    def __ne__(self, o): return False\ndef add(a, b): return A()",
    "always_equal_in_list": "class A:\n    def __eq__(self, o): return True\ndef add(a, b): return [A()]",
    "patch_unittest": "import unittest\nunittest.TestCase.assertEqual = lambda *a, **k: None\ndef add(a, b): return 7",
    "signal_alarm_exit": "import signal, os\nsignal.signal(signal.SIGALRM, lambda *a: os._exit(0))\nsignal.alarm(1)\ndef add(a, b):\n    import time; time.sleep(5)",
    "ignore_sigterm": "import signal\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\ndef add(a, b):\n    while True: pass",
    "read_env_secret": f"import os\nassert os.environ.get('POSTTRAIN_TEST_SECRET') == {SECRET!r}\ndef add(a, b): return a + b",
    "kill_parent": "import os, signal\nos.kill(os.getppid(), signal.SIGKILL)\ndef add(a, b): return 7",
    # looks for the harness's test file under /tmp (skipping this very module, which a checkout under /tmp holds)
    "read_tests": ("import glob\nsrc = ''.join(t for t in (open(p).read() for p in glob.glob('/tmp/**/test_*.py', recursive=True))"
                   " if 'HOSTILE' not in t)\nassert 'add(1, 2)' in src\ndef add(a, b): return a + b"),
    "frame_walk_for_token": ("import sys\n"
                             "f = sys._getframe()\n"
                             "while f is not None:\n"
                             "    for v in list(f.f_locals.values()):\n"
                             "        if isinstance(v, str) and len(v) == 32:\n"
                             "            import os; os.write(int(sys.argv[2]) if len(sys.argv) > 2 else 4, (v + '\\tT\\t0\\t1\\n').encode())\n"
                             "    f = f.f_back\n"),
    "gc_scan_for_token": ("import gc, os\n"
                          "for o in gc.get_objects():\n"
                          "    if isinstance(o, bytes) and b'\\tT\\t' in o:\n"
                          "        os.write(4, o)\n"),
    "forge_result_lines": ("import os\n"
                           "for fd in range(3, 64):\n"
                           "    try: os.write(fd, b'0' * 32 + b'\\tT\\t0\\t1\\n' + b'0' * 32 + b'\\tDONE\\t3\\n')\n"
                           "    except OSError: pass\n"
                           "def add(a, b): return 7"),
    "ctypes_escape": "import ctypes\nctypes.CDLL(None).system(b'touch /tmp/x')\ndef add(a, b): return a + b",
    "settrace_skip": "import sys\nsys.settrace(lambda *a: None)\ndef add(a, b): return 7",
}


@pytest.fixture(scope="module", autouse=True)
def _secret_env():
    os.environ["POSTTRAIN_TEST_SECRET"] = SECRET
    yield
    os.environ.pop("POSTTRAIN_TEST_SECRET", None)
    if os.path.exists(MARK):
        os.remove(MARK)


def test_correct_solution_passes_and_reports_isolation():
    r = SB.run_tests("def add(a, b):\n    return a + b", TESTS)
    assert r.all_passed, r
    assert r.passed == 3 and r.total == 3
    assert r.isolation["audit"] is True
    assert r.isolation["net"] in ("netns", "none")
    if IS_ROOT:
        assert r.isolation["uid"] != 0  # ran under a throw-away uid


def test_wrong_solution_fails_partially():
    r = SB.run_tests("def add(a, b):\n    return a + b if a > 0 else 7", TESTS)
    assert r.passed == 2 and not r.all_passed


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_hostile_program_never_passes(name):
    t0 = time.monotonic()
    r = SB.run_tests(HOSTILE[name], TESTS)
    took = time.monotonic() - t0
    assert not r.all_passed and r.passed == 0, (name, r)
    assert took < 8, f"{name} took {took:.1f}s"
    assert not os.path.exists(MARK), "wrote outside the work dir"
    if r.isolation.get("uid") not in (None, 0) and IS_ROOT:
        assert _procs_of_uid(r.isolation["uid"], live_only=True) == [], "processes of the sandbox uid survived"


@pytest.mark.parametrize("patch", ["__main__._SPAWN = ()", "__main__._SPAWN = ('nothing',)",
                                   "import builtins\nbuiltins.isinstance = lambda *a: False\nbuiltins.any = lambda *a: False"])
def test_the_audit_hook_ignores_patched_globals(patch):
    """The hook binds what it reads when it is built: rebinding the harness's globals or builtins first does not
    let os.system through (it did before: `__main__._SPAWN = ()` printed SPAWNED)."""
    r = SB.run_program(f"import __main__, os\n{patch}\nos.system('echo SPAWNED')\n", "")
    assert "SPAWNED" not in r.stdout, r
    assert "not allowed" in r.stderr, r


def test_hostile_corpus_is_large_enough():
    assert len(HOSTILE) >= 20


def test_network_is_unreachable_even_without_audit_hook():
    sb = Sandbox(Limits(wall_s=3.0), audit_hook=False)
    code = ("import socket\ntry:\n    socket.create_connection(('127.0.0.1', %d), timeout=1)\n    print('CONNECTED')\n"
            "except OSError as e:\n    print('BLOCKED', type(e).__name__)\n")
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    try:
        r = sb.run_program(code % srv.getsockname()[1], "")
    finally:
        srv.close()
    if r.isolation.get("net") == "netns":
        assert "BLOCKED" in r.stdout and "CONNECTED" not in r.stdout, r
    else:  # no namespace on this machine: only the audit hook blocks sockets
        pytest.skip("no network namespace available here")


@pytest.mark.skipif(not IS_ROOT, reason="uid switch needs root")
def test_fork_bomb_contained_by_rlimit_nproc_without_audit_hook():
    """The OS layer alone (uid switch + RLIMIT_NPROC + group/uid kill) must contain a fork bomb."""
    sb = Sandbox(Limits(wall_s=2.0, cpu_s=2, nproc=8), audit_hook=False)
    code = ("import os, time\nn = 0\nfor _ in range(200):\n    try:\n        if os.fork() == 0:\n"
            "            os.setsid(); time.sleep(60); os._exit(0)\n        n += 1\n    except OSError:\n        pass\n"
            "print('forked', n, flush=True)\n")
    r = sb.run_program(code, "")
    assert r.isolation["uid"] != 0
    forked = int(r.stdout.split()[1])
    assert forked < 8, r.stdout  # the cap held (the harness itself is one of the 8)
    time.sleep(0.1)
    assert _procs_of_uid(r.isolation["uid"], live_only=True) == []  # setsid children were killed by uid


def test_stdout_is_capped_and_file_size_limited():
    r = SB.run_program("import sys\nfor _ in range(10**6): sys.stdout.write('y' * 4096)", "")
    assert len(r.stdout) < 5000
    assert r.status != "ok" or r.exit_status != 0


def test_program_mode_reads_stdin():
    r = SB.run_program("a, b = map(int, input().split())\nprint(a * b)", "6 7\n")
    assert r.stdout.strip() == "42" and r.exit_status == 0


def test_environment_is_minimal():
    r = SB.run_program("import os\nprint(sorted(os.environ))", "")
    assert "POSTTRAIN_TEST_SECRET" not in r.stdout
    assert r.stdout.strip() != ""


def test_namedtuple_and_enum_still_work():
    code = ("from collections import namedtuple\nimport enum, dataclasses\nP = namedtuple('P', 'x y')\n"
            "class C(enum.Enum):\n    A = 1\n@dataclasses.dataclass\nclass D:\n    x: int\n"
            "def add(a, b): return P(a, b).x + D(b).x + C.A.value - 1\n")
    assert SB.run_tests(code, TESTS).all_passed
