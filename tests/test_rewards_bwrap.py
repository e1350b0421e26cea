"""Filesystem isolation of the code sandbox with bubblewrap (posttrain/rewards/bwrap.py, docs/rewards.md): programs
that read the host's files (home, the project, /etc, other users' homes, the host /tmp, /proc of other processes)
get nothing under the sandbox, with every layer and with bubblewrap alone; the same programs do read them with
filesystem="none" (the control: the probes can fail); HumanEval-style reference solutions still pass; a missing or
refused bwrap falls back with one notice."""

import os
import random
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from posttrain.data.tasks.code import humaneval_mini, reference
from posttrain.rewards import bwrap
from posttrain.rewards.code import make_code_reward
from posttrain.rewards.sandbox import Limits, Sandbox, SandboxUnavailable

pytestmark = pytest.mark.timeout(120)

LIMITS = Limits(wall_s=5.0, cpu_s=5, memory_mb=512, nproc=16, output_bytes=8192)
SECRET = "posttrain-bwrap-secret-9d2e"
REPO = Path(__file__).resolve().parent.parent
PROBE_NAME = f".posttrain_sbx_probe_{os.getpid()}"


def _bwrap_reason() -> str | None:
    return Sandbox(LIMITS, audit_hook=False, switch_uid=False).fs_reason


needs_bwrap = pytest.mark.skipif(_bwrap_reason() is not None,
                                 reason=f"no filesystem isolation here: {_bwrap_reason()} ({bwrap.INSTALL_HINT})")


@pytest.fixture(scope="module")
def host_files():
    """World-readable files holding SECRET in the home dir and the host /tmp; another process with SECRET in its
    environment (/proc/<pid>/environ)."""
    home, tmp = Path.home() / PROBE_NAME, Path("/tmp") / PROBE_NAME
    for p in (home, tmp):
        p.write_text(SECRET)
        p.chmod(0o644)
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], env={"SECRET": SECRET})
    yield {"home": str(home), "tmp": str(tmp), "pid": other.pid}
    other.kill()
    other.wait()
    for p in (home, tmp):
        p.unlink(missing_ok=True)


def _try(name: str, body: str) -> str:
    """A program that prints LEAK:name when `body` (which sets `got`) found what it looked for."""
    indented = "\n".join("    " + line for line in body.splitlines())
    return f"import glob, os\ngot = False\ntry:\n{indented}\nexcept Exception as e:\n    print('blocked', type(e).__name__)\nif got:\n    print('LEAK:{name}')\n"


def hostile(files: dict) -> dict[str, str]:
    s, home, tmp, pid = SECRET, files["home"], files["tmp"], files["pid"]
    return {
        "home_file": _try("home_file", f"got = {s!r} in open({home!r}).read()"),
        "home_listing": _try("home_listing", f"got = {PROBE_NAME!r} in os.listdir({os.path.dirname(home)!r})"),
        "project_source": _try("project_source", f"got = 'posttrain' in open({str(REPO / 'pyproject.toml')!r}).read()"),
        "project_listing": _try("project_listing", f"got = 'posttrain' in os.listdir({str(REPO)!r})"),
        "etc_passwd": _try("etc_passwd", "got = 'root:' in open('/etc/passwd').read()"),
        "etc_listing": _try("etc_listing", "got = len(os.listdir('/etc')) > 0"),
        "other_users_homes": _try("other_users_homes", "got = any(open(p).read(1) for p in glob.glob('/home/*/.*') if os.path.isfile(p))"),
        "host_tmp": _try("host_tmp", f"got = {s!r} in open({tmp!r}).read()"),
        "proc_of_other_process": _try("proc_of_other_process", f"got = {s!r}.encode() in open('/proc/{pid}/environ', 'rb').read()"),
        "proc_scan": _try("proc_scan", "for p in glob.glob('/proc/[0-9]*/environ'):\n    try:\n"
                                       f"        got = got or {s!r}.encode() in open(p, 'rb').read()\n"
                                       "    except OSError:\n        pass"),
        "proc_cmdlines": _try("proc_cmdlines", "got = any(b'pytest' in open(p, 'rb').read() for p in glob.glob('/proc/[0-9]*/cmdline'))"),
        "proc_root_of_pid1": _try("proc_root_of_pid1", "got = 'root:' in open('/proc/1/root/etc/passwd').read()"),
        "symlink_out": _try("symlink_out", "os.symlink('/etc/passwd', 'p')\ngot = 'root:' in open('p').read()"),
    }


def _run_all(sb: Sandbox, files: dict) -> dict[str, str]:
    return {name: sb.run_program(code, "").stdout for name, code in hostile(files).items()}


@needs_bwrap
@pytest.mark.parametrize("layers", ["all", "bwrap_alone"])
def test_host_files_are_invisible(host_files, layers):
    """Every layer on (the default sandbox), and bubblewrap alone (no audit hook, no uid switch: root here)."""
    sb = Sandbox(LIMITS) if layers == "all" else Sandbox(LIMITS, audit_hook=False, switch_uid=False, filesystem="bwrap")
    out = _run_all(sb, host_files)
    leaks = {name: text for name, text in out.items() if "LEAK" in text or SECRET in text}
    assert leaks == {}, leaks
    assert all("blocked" in text or text.strip() == "" for text in out.values()), out


def test_the_probes_read_the_host_without_isolation(host_files):
    """The control: with filesystem="none" and the in-process layers off, the same programs do get the files (so the
    test above can fail). /proc of other processes and world-readable files are then open to the program."""
    sb = Sandbox(LIMITS, audit_hook=False, switch_uid=False, filesystem="none")
    out = _run_all(sb, host_files)
    leaked = {name for name, text in out.items() if f"LEAK:{name}" in text}
    assert {"home_file", "project_source", "project_listing", "etc_passwd", "host_tmp", "proc_of_other_process", "proc_scan",
            "proc_cmdlines"} <= leaked, out
    # every other layer on (audit hook, throw-away uid as root): world-readable files still leak without bubblewrap
    out = _run_all(Sandbox(LIMITS, filesystem="none"), host_files)
    leaked = {name for name, text in out.items() if f"LEAK:{name}" in text}
    # the project's files leak only where the checkout is world-readable (a clone under `mktemp -d` is not: 0700)
    expected = {"etc_passwd", "host_tmp"} | ({"project_source"} if world_readable(REPO / "pyproject.toml") else set())
    assert expected <= leaked, out


def world_readable(path: Path) -> bool:
    """Readable by any user: the file has o+r and every folder above it o+x."""
    import stat

    return bool(path.stat().st_mode & stat.S_IROTH) and all(p.stat().st_mode & stat.S_IXOTH for p in path.parents)


@needs_bwrap
def test_what_the_sandbox_sees():
    """The root holds only the system dirs, the interpreter, the harness and the work dir; /proc only the sandbox's."""
    sb = Sandbox(LIMITS, audit_hook=False)
    code = ("import os, sys\nprint(sorted(os.listdir('/')))\nprint(sorted(p for p in os.listdir('/proc') if p.isdigit()))\n"
            "print(os.getcwd() == os.environ['HOME'], os.access(os.getcwd(), os.W_OK), os.access('/usr', os.W_OK))\n")
    r = sb.run_program(code, "")
    assert r.exit_status == 0, r
    top, pids, flags = r.stdout.splitlines()
    extra = set(eval(top)) - {"usr", "bin", "sbin", "lib", "lib32", "lib64", "libx32", "proc", "dev", "sandbox", "tmp"}
    prefixes = {p.strip("/").split("/")[0] for p in sb.layout.binds}  # the interpreter's own prefix, when not in /usr
    assert extra <= prefixes, extra
    assert eval(pids) == ["1"], pids  # the harness is the namespace's pid 1; nothing of the host
    assert flags == "True True False"
    assert r.isolation["fs"] == "bwrap" and r.isolation["pid"] == "pidns" and r.isolation["net"] == "netns"


def _zombie_children() -> list[str]:
    out = []
    for pid in (p for p in os.listdir("/proc") if p.isdigit()):
        try:
            state, ppid = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[:2]
        except OSError:
            continue
        if int(ppid) == os.getpid() and state == "Z":
            out.append(pid)
    return out


@needs_bwrap
def test_no_process_outlives_a_run():
    """bwrap's own init (without --as-pid-1) outlived the outer bwrap and was left a zombie of the trainer (the
    sandbox's subreaper as root) after every run."""
    sb = Sandbox(Limits(wall_s=1.0, cpu_s=1))
    before = set(_zombie_children())
    for code in ("print(1)", "import os\nos._exit(3)", "while True: pass"):
        sb.run_program(code, "")
    assert set(_zombie_children()) - before == set()


@needs_bwrap
def test_humaneval_references_pass_under_bwrap():
    """The repo's HumanEval-style corpus: every reference solution scores 1, a wrong one 0, in the bwrap sandbox."""
    rows = humaneval_mini(None, random.Random(0))
    good = [f"```python\n{reference(r['entry_point'])}```" for r in rows]
    bad = [f"def {r['entry_point']}(*args):\n    return None\n" for r in rows]
    reward = make_code_reward(wall_s=10.0, filesystem="bwrap")
    scores = reward([r["prompt"] for r in rows] * 2, good + bad, tests=[r["tests"] for r in rows] * 2)
    assert scores == [1.0] * len(rows) + [0.0] * len(rows)
    assert reward.last_metrics["filesystem"] == "bwrap"


@needs_bwrap
def test_site_packages_interpreter_runs_under_bwrap():
    """site_packages=True binds the interpreter's site-packages (read-only) and still hides the project folder."""
    sb = Sandbox(LIMITS, site_packages=True, switch_uid=False, audit_hook=False, python=sys.executable, filesystem="bwrap")
    r = sb.run_program(f"import json, sys\nprint(len(sys.path) > 0)\nimport os\nprint(os.path.exists({str(REPO / 'posttrain')!r}))", "")
    assert r.stdout.split() == ["True", "False"], r


@pytest.fixture
def fresh_probe(monkeypatch):
    monkeypatch.setattr(bwrap, "_PROBED", {})
    monkeypatch.setattr(bwrap, "_NOTICED", set())
    monkeypatch.delenv("POSTTRAIN_SANDBOX_NOTICE", raising=False)
    return monkeypatch


def test_missing_bwrap_falls_back_with_one_notice(fresh_probe, capsys):
    fresh_probe.setenv("POSTTRAIN_BWRAP", "")  # as if not installed
    a, b = Sandbox(LIMITS), Sandbox(LIMITS)
    assert a.layout is None and "not installed" in a.fs_reason
    err = capsys.readouterr().err
    assert err.count("posttrain sandbox: no filesystem isolation") == 1, err
    assert "apt-get install -y bubblewrap" in err
    r = b.run_tests("def add(a, b):\n    return a + b", ["assert add(1, 2) == 3"])
    assert r.all_passed and r.isolation["fs"].startswith("host (") and r.isolation["pid"] == "host"
    with pytest.raises(SandboxUnavailable, match="not installed"):
        Sandbox(LIMITS, filesystem="bwrap")


def test_refused_namespaces_fall_back(fresh_probe, tmp_path, capsys):
    """A bwrap that cannot create its namespaces (unprivileged user namespaces off, a strict container) is found
    out by the start-up probe: the runs fall back to the other layers, and the notice says why."""
    fake = tmp_path / "bwrap"
    fake.write_text("#!/bin/sh\necho 'bwrap: No permissions to creating new namespace, likely because the kernel "
                    "does not allow non-privileged user namespaces.' >&2\nexit 1\n")
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    fresh_probe.setenv("POSTTRAIN_BWRAP", str(fake))
    sb = Sandbox(LIMITS)
    assert sb.layout is None and "No permissions to creating new namespace" in sb.fs_reason
    assert "user namespaces" in capsys.readouterr().err
    r = sb.run_program("print(6 * 7)", "")
    assert r.stdout.strip() == "42" and r.isolation["fs"].startswith("host (")
