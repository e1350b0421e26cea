"""Sandboxed execution of untrusted Python for code rewards (docs/rewards.md, "Code: the sandbox and its threat model").

One fresh interpreter per run, `python -I -S -B` (isolated: no env vars, no user site, no script
dir on sys.path; -S: no site-packages, so the solution sees only the standard library and starts
~2x faster; pass `site_packages=True` to allow numpy & co.), started in its own session and killed
as a process group. The harness (`_harness.py`) runs first inside the child and, before the
solution gets control, enters a network namespace, sets PR_SET_NO_NEW_PRIVS, switches to a
throw-away uid when we are root (RLIMIT_NPROC does not apply to root, so a fork bomb would
otherwise be uncapped), sets rlimits and installs an audit hook.

Threat model and what each layer stops (see docs/rewards.md):
- control-flow tricks (`os._exit(0)`, `sys.exit(0)`, swallowing AssertionError, patched `unittest`
  or builtins, signal handlers) -> a pass needs lines carrying a random token the parent generated,
  written by the harness after each test and after the last one;
- `__eq__` hijacking -> `assert a == b` is compiled to a strict comparison;
- reading the tests -> they are never written to the sandbox's filesystem (sent over an fd the
  harness reads and closes before the solution runs); stdin/stdout expectations stay in the parent;
- resource abuse -> rlimits (CPU, address space, file size, open files, processes), wall timeout,
  output captured into files capped by RLIMIT_FSIZE and truncated on read;
- network -> a fresh network namespace (no interfaces but a down loopback) where the kernel allows
  it, otherwise the audit hook refuses every socket event; the result says which;
- host damage -> temp work dir, minimal environment (no secrets from the parent), other uid,
  kill of the process group and (as root) of every process of the sandbox uid;
- reading the host's files (home, the project, /etc, other users' data, /proc/<pid> of other processes)
  -> bubblewrap (`bwrap.py`) when installed and permitted: the program sees its work dir, a read-only
  Python and system libraries, a fresh /proc (own pid namespace) and /dev, nothing else; otherwise one
  notice on stderr and the other layers only (`filesystem="auto"`; "bwrap" requires it, "none" skips it).
"""

from __future__ import annotations

import json
import os
import random
import secrets
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from posttrain.rewards import bwrap

HARNESS = str(Path(__file__).with_name("_harness.py"))
IS_ROOT = os.geteuid() == 0


@dataclass
class Limits:
    """Per-run limits. `nproc` counts processes *and threads* of the sandbox uid."""

    wall_s: float = 10.0
    cpu_s: int = 10
    memory_mb: int = 1024
    fsize_mb: int = 16
    nofile: int = 64
    nproc: int = 32
    output_bytes: int = 64 * 1024


@dataclass
class RunResult:
    status: str  # "ok" (ran to the end), "timeout", "crashed" (no DONE line), "error" (sandbox failure)
    passed: int = 0
    total: int = 0
    stdout: str = ""
    stderr: str = ""
    returncode: int | None = None
    wall_s: float = 0.0
    isolation: dict = field(default_factory=dict)
    exit_status: int | None = None  # program mode: 0 when the program ended normally

    @property
    def all_passed(self) -> bool:
        return self.status == "ok" and self.total > 0 and self.passed == self.total

    def to_dict(self) -> dict:
        return asdict(self)


def outputs_match(got: str, expected: str) -> bool:
    """A program's stdout against a stdio case's expected output, trailing spaces and outer blank lines ignored
    (the local sandbox's runs and the remote service's are compared alike)."""
    norm = lambda s: "\n".join(line.rstrip() for line in s.strip().splitlines())
    return norm(got) == norm(expected)


def _world_readable(path: str) -> bool:
    """True if a uid with no rights other than 'other' can read `path` (all parents o+x)."""
    p = Path(path).resolve()
    try:
        if not p.stat().st_mode & stat.S_IROTH:
            return False
        return all(d.stat().st_mode & stat.S_IXOTH for d in p.parents)
    except OSError:
        return False


_PYTHON_CACHE: dict[bool, str] = {}


def pick_python(switch_uid: bool) -> str:
    """An interpreter the sandbox uid can run: ours if readable by 'other', else a system one."""
    if switch_uid in _PYTHON_CACHE:
        return _PYTHON_CACHE[switch_uid]
    candidates = [sys.executable, "/usr/bin/python3", "/usr/local/bin/python3", shutil.which("python3") or ""]
    chosen = sys.executable
    if switch_uid:
        for c in candidates:
            if not c or not os.path.exists(c):
                continue
            try:
                out = subprocess.run([c, "-I", "-S", "-c", "import os,sys;print(sys.version_info>=(3,8));print(os.__file__)"],
                                     capture_output=True, text=True, timeout=10).stdout.split()
            except (OSError, subprocess.SubprocessError):
                continue
            if len(out) == 2 and out[0] == "True" and _world_readable(c) and _world_readable(out[1]):
                chosen = c
                break
        else:
            chosen = ""  # no interpreter the sandbox uid can read: run without the uid switch
    _PYTHON_CACHE[switch_uid] = chosen
    return chosen


def _procs_of_uid(uid: int, live_only: bool = False) -> list[int]:
    """Pids owned by `uid` (with live_only, zombies are left out)."""
    pids = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            if os.stat(f"/proc/{name}").st_uid != uid:
                continue
            if live_only:
                with open(f"/proc/{name}/stat") as f:
                    if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                        continue
            pids.append(int(name))
        except (OSError, IndexError):
            pass
    return pids


_SUBREAPER = False


def _become_subreaper() -> None:
    """PR_SET_CHILD_SUBREAPER: orphans of our sandboxes (children that called setsid() and
    outlived the harness) are re-parented to us, so we can reap them after killing them; some
    container inits never reap, leaving zombies that count against the pid table."""
    global _SUBREAPER
    if not _SUBREAPER:
        import ctypes

        _SUBREAPER = ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0) == 0


def _reap(pids: list[int]) -> None:
    for pid in pids:
        try:
            os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            pass


def _kill_uid(uid: int, python: str) -> None:
    """Kill every process of `uid`: kill(-1, SIGKILL) from a helper running as that uid is atomic
    with respect to fork (the kernel holds the tasklist lock), so a fork bomb cannot outrun it."""
    for _ in range(5):
        pids = _procs_of_uid(uid)
        _reap(pids)
        if not _procs_of_uid(uid, live_only=True):
            _reap(pids)
            return
        subprocess.run([python, "-I", "-S", "-c", "import os,signal\ntry: os.kill(-1, signal.SIGKILL)\nexcept OSError: pass"],
                       user=uid, group=uid, extra_groups=[], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                       timeout=10, cwd="/")
        time.sleep(0.01)


def _read_capped(f, cap: int) -> str:
    f.seek(0)
    data = f.read(cap + 1)
    text = data[:cap].decode("utf-8", "replace")
    return text + ("\n...[truncated]" if len(data) > cap else "")


def _rmtree(path: str) -> None:
    def onerror(func, p, exc):  # the program may have chmod-ed things read-only
        try:
            os.chmod(p, 0o700)
            os.chmod(os.path.dirname(p), 0o700)
            func(p)
        except OSError:
            pass

    shutil.rmtree(path, onerror=onerror)


class SandboxUnavailable(RuntimeError):
    """`filesystem="bwrap"` was asked for and bubblewrap cannot run here (the message says why)."""


class Sandbox:
    """Runs untrusted Python. `run_tests` for assert-style tests, `run_program` for stdin/stdout.

    `filesystem`: "auto" (bubblewrap when it runs here, else the other layers and one notice), "bwrap"
    (required: SandboxUnavailable otherwise), "none" (the host filesystem, as without bubblewrap)."""

    def __init__(self, limits: Limits | None = None, *, netns: bool = True, switch_uid: bool = True,
                 audit_hook: bool = True, allow_spawn: bool = False, site_packages: bool = False,
                 python: str | None = None, filesystem: str = "auto"):
        if filesystem not in ("auto", "bwrap", "none"):
            raise ValueError("filesystem must be 'auto', 'bwrap' or 'none'")
        self.limits = limits or Limits()
        self.netns, self.audit_hook, self.allow_spawn = netns, audit_hook, allow_spawn
        self.site_packages = site_packages
        self.switch_uid = switch_uid and IS_ROOT
        chosen = python or pick_python(self.switch_uid)
        if not chosen:
            self.switch_uid, chosen = False, sys.executable
        self.python = chosen
        if self.switch_uid:
            _become_subreaper()
        self.layout, self.fs_reason = None, "filesystem='none'"
        if filesystem != "none":
            self.layout, self.fs_reason = bwrap.isolation_for(chosen, site_packages, net=netns, keep_setuid=self.switch_uid)
            if self.layout is None and filesystem == "bwrap":
                raise SandboxUnavailable(f"filesystem='bwrap': {self.fs_reason}; {bwrap.INSTALL_HINT}")
            if self.layout is None:
                bwrap.notice_once(self.fs_reason)

    # ------------------------------------------------------------------ public API
    def run_tests(self, code: str, tests: list[str] | str) -> RunResult:
        """Each element of `tests` is one test (assert statements, or a block such as HumanEval's
        `def check(candidate): ...` + `check(f)`). Passed = tests with a token-signed pass line."""
        tests = [tests] if isinstance(tests, str) else list(tests)
        return self._run({"mode": "tests", "code": code, "tests": tests}, b"")

    def run_program(self, code: str, stdin: str) -> RunResult:
        """Run `code` as a script on `stdin`; the caller compares `stdout`."""
        return self._run({"mode": "program", "code": code, "tests": []}, stdin.encode())

    # ------------------------------------------------------------------ one run
    def _run(self, job: dict, stdin: bytes) -> RunResult:
        lim = self.limits
        token = secrets.token_hex(16)
        test_tokens = [secrets.token_hex(16) for _ in job["tests"]]
        root = tempfile.mkdtemp(prefix="posttrain-sbx-")
        uid = random.randrange(200_000, 2_000_000) if self.switch_uid else None
        work = os.path.join(root, "work")
        os.mkdir(work, 0o700)
        if uid is not None:
            os.chmod(root, 0o711)  # traversable, not listable
            os.chown(work, uid, uid)
        job = dict(job, token=token, test_tokens=test_tokens, workdir=work, uid=uid, netns=self.netns, audit=self.audit_hook,
                   allow_spawn=self.allow_spawn, limits=asdict(lim), netns_done=self.layout is not None and self.netns)
        if uid is None and not IS_ROOT:  # counted here: inside bwrap's pid namespace the user's other processes are invisible
            job["nproc_base"] = len(_procs_of_uid(os.getuid()))
        files = [tempfile.TemporaryFile(dir=root) for _ in range(5)]  # unlinked: no path to find them by
        f_in, f_stdin, f_out, f_err, f_res = files
        f_in.write(json.dumps(job).encode())
        f_in.seek(0)
        f_stdin.write(stdin)
        f_stdin.seek(0)
        env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8", "HOME": work, "TMPDIR": work}
        flags = ["-I", "-B"] + ([] if self.site_packages else ["-S"])
        fds = [str(f_in.fileno()), str(f_res.fileno())]
        if self.layout is not None:
            argv = bwrap.command(self.layout, HARNESS, work, net=self.netns, keep_setuid=uid is not None)
            argv += [self.layout.exe, *flags, bwrap.HARNESS_PATH, *fds]
        else:
            argv = [self.python, *flags, HARNESS, *fds]
        t0 = time.monotonic()
        status, rc = "ok", None
        try:
            proc = subprocess.Popen(argv, stdin=f_stdin, stdout=f_out, stderr=f_err, cwd=work, env=env,
                                    pass_fds=(f_in.fileno(), f_res.fileno()), start_new_session=True, close_fds=True)
        except OSError as e:
            for f in files:
                f.close()
            _rmtree(root)
            return RunResult(status="error", stderr=f"sandbox failed to start: {e}")
        f_in.close()  # the child has its copy; ours must not be reachable through /proc/<pid>/fd
        try:
            rc = proc.wait(timeout=lim.wall_s)
        except subprocess.TimeoutExpired:
            status = "timeout"
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)  # the whole session, including children
            except (ProcessLookupError, PermissionError):
                pass
            if rc is None:
                rc = proc.wait()
            if uid is not None:
                _kill_uid(uid, self.python)  # children that called setsid() left the group
        wall = time.monotonic() - t0
        result = RunResult(status=status, returncode=rc, wall_s=wall,
                           stdout=_read_capped(f_out, lim.output_bytes), stderr=_read_capped(f_err, lim.output_bytes))
        f_res.seek(0)
        lines = f_res.read(1 << 20).decode("utf-8", "replace").splitlines()
        for f in (f_stdin, f_out, f_err, f_res):
            f.close()
        _rmtree(root)
        self._parse(result, lines, token, test_tokens)
        if result.isolation:  # what the OS layers outside the harness achieved
            result.isolation["fs"] = "bwrap" if self.layout is not None else f"host ({self.fs_reason})"
            result.isolation["pid"] = "pidns" if self.layout is not None else "host"
        return result

    @staticmethod
    def _parse(result: RunResult, lines: list[str], token: str, test_tokens: list[str]) -> None:
        """Count only lines signed with a token of this run; test i needs its own token."""
        n_tests = len(test_tokens)
        expected = {f"{t}\tT\t{i}\t1": i for i, t in enumerate(test_tokens)}
        passed, done = set(), False
        for line in lines:
            if line in expected:
                passed.add(expected[line])
                continue
            parts = line.split("\t")
            if parts[0] != token or len(parts) < 3:
                continue  # anything not signed with this run's token is ignored
            kind = parts[1]
            if kind == "ISO":
                result.isolation = json.loads(parts[2])
            elif kind == "DONE":
                done = True
            elif kind == "EXIT":
                result.exit_status, done = int(parts[2]), True
        result.total = n_tests
        result.passed = len(passed)
        if result.status == "ok" and not done:
            result.status = "crashed"
