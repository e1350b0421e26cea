"""Filesystem isolation for the sandbox with bubblewrap (`bwrap`), when it is installed and allowed.

The sandboxed interpreter is started as `bwrap <below> -- PYTHON -I -B [-S] /sandbox/harness.py ...`. It sees:

    /usr, /lib*, /bin, /sbin   read-only (or the host's symlinks into /usr): libc, the system libraries
    the interpreter's prefixes  read-only: sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix
                               and the directory of the interpreter binary (with `site_packages`, its
                               site-packages directories; never a sys.path entry outside them, so an
                               editable install's project folder stays hidden)
    /sandbox/harness.py        read-only: the trusted harness (the only file of the project)
    the work dir               read-write, at its host path (/tmp/posttrain-sbx-XXXX/work)
    /proc, /dev                a fresh procfs of a new pid namespace (the sandbox's own processes only)
                               and a minimal /dev (null, zero, random, urandom, tty, pts, shm)

and nothing else of the host: no /etc (no passwd, hosts, ...), /home, /root, /work, /tmp, /var, /opt, /srv,
/mnt, no other process's /proc/<pid>. Namespaces: pid, network (no interfaces but a down loopback),
ipc, uts, cgroup where available, a user namespace when not root. `--as-pid-1`: the interpreter is the namespace's
pid 1, so every process it started dies with it, and bwrap keeps no init process that would outlive the outer bwrap
(a zombie of the trainer, the sandbox's subreaper, after every run). Capabilities: none, except that as root
CAP_SETUID/CAP_SETGID stay for the harness to drop to the throw-away uid (it does so before untrusted code
runs, which clears them). --die-with-parent: killing bwrap (the wall timeout) kills the namespace.

`probe(layout)` runs the exact command once per process (`python -c pass` in it): bwrap missing, user
namespaces not permitted (non-root without unprivileged user namespaces, some containers), or a mount the
kernel refuses all fall back to the other layers with one notice on stderr naming the reason.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from functools import lru_cache

HARNESS_PATH = "/sandbox/harness.py"  # where the harness file appears inside the sandbox
SYSTEM_DIRS = ("/usr", "/lib", "/lib32", "/lib64", "/libx32", "/bin", "/sbin")
INSTALL_HINT = "install bubblewrap (Debian/Ubuntu: apt-get install -y bubblewrap; `make test` does it as root)"


def bwrap_path() -> str | None:
    """The bwrap binary: $POSTTRAIN_BWRAP when set (empty: treat as missing), else `bwrap` on PATH."""
    override = os.environ.get("POSTTRAIN_BWRAP")
    if override is not None:
        return override or None
    return shutil.which("bwrap") or next((p for p in ("/usr/bin/bwrap", "/bin/bwrap") if os.access(p, os.X_OK)), None)


@dataclass(frozen=True)
class Layout:
    """What one interpreter needs inside the sandbox."""

    bwrap: str
    exe: str  # the path exec'ed inside (the interpreter binary, or the venv's python with site_packages)
    binds: tuple[str, ...]  # host directories bound read-only at the same path, besides SYSTEM_DIRS


def _covered(path: str, roots) -> bool:
    return any(path == r or path.startswith(r.rstrip("/") + "/") for r in roots)


@lru_cache(maxsize=None)
def _python_dirs(python: str, site_packages: bool) -> tuple[str, tuple[str, ...]]:
    """(binary's real path, the prefixes and (with site_packages) site-packages directories of `python`)."""
    code = ("import json, os, sys\nd = [sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix]\n"
            "if %r:\n    import site\n    d += site.getsitepackages()\n"
            "print(json.dumps([os.path.realpath(sys.executable), d]))" % site_packages)
    out = subprocess.run([python, "-I", "-S", "-c", code], capture_output=True, text=True, timeout=30, check=True)
    exe, dirs = json.loads(out.stdout)
    return exe, tuple(dirs)


def python_layout(bwrap: str, python: str, site_packages: bool) -> Layout:
    """The read-only binds `python` needs: its prefixes (and site-packages), minus what SYSTEM_DIRS covers.
    Never "/" (that would bind the whole host)."""
    real, dirs = _python_dirs(python, site_packages)
    wanted = [os.path.dirname(real), *(os.path.realpath(d) for d in dirs)]
    if site_packages:
        wanted.append(os.path.dirname(os.path.abspath(python)))  # a venv's bin/ (pyvenv.cfg sits above it)
    binds: list[str] = []
    for d in sorted(set(wanted), key=len):
        if d != "/" and os.path.isdir(d) and not _covered(d, SYSTEM_DIRS) and not _covered(d, binds):
            binds.append(d)
    # without site-packages the venv is not needed: exec the interpreter binary itself
    return Layout(bwrap, os.path.abspath(python) if site_packages else real, tuple(binds))


def _system_args() -> list[str]:
    args = []
    for d in SYSTEM_DIRS:
        if os.path.islink(d):  # merged /usr: /lib -> usr/lib
            args += ["--symlink", os.readlink(d), d]
        elif os.path.isdir(d):
            args += ["--ro-bind", d, d]
    return args


def _parents(paths) -> list[str]:
    """`--perms 0755 --dir` for every missing ancestor of the bind targets: bwrap would create them with its
    umask (0700 under a 077 umask), which the throw-away uid could not traverse."""
    out: list[str] = []
    seen: set[str] = set()
    for p in paths:
        parts = p.strip("/").split("/")[:-1]
        for i in range(1, len(parts) + 1):
            d = "/" + "/".join(parts[:i])
            if d not in seen and not _covered(d, SYSTEM_DIRS):
                seen.add(d)
                out += ["--perms", "0755", "--dir", d]
    return out


def command(layout: Layout, harness: str, workdir: str, *, net: bool, keep_setuid: bool) -> list[str]:
    """The bwrap argv up to and including `--`; the interpreter's argv follows."""
    root = os.geteuid() == 0
    args = [layout.bwrap, "--die-with-parent", "--new-session", "--unshare-pid", "--as-pid-1", "--unshare-ipc", "--unshare-uts",
            "--unshare-cgroup-try"]
    if net:
        args.append("--unshare-net")
    if not root:
        args.append("--unshare-user")  # an unprivileged bwrap needs a user namespace for its mounts
    args += ["--cap-drop", "ALL"]
    if root and keep_setuid:  # the harness drops to the throw-away uid itself, before untrusted code runs
        args += ["--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID"]
    args += _system_args()
    args += _parents(layout.binds + (HARNESS_PATH, workdir))
    for d in layout.binds:
        args += ["--ro-bind", d, d]
    args += ["--ro-bind", harness, HARNESS_PATH, "--bind", workdir, workdir, "--proc", "/proc", "--dev", "/dev",
             "--chdir", "/", "--"]  # the harness enters the work dir after its uid switch (0700, the sandbox uid's)
    return args


_PROBED: dict[tuple[str, str, bool, bool], str | None] = {}
_NOTICED: set[str] = set()


def probe(layout: Layout, *, net: bool, keep_setuid: bool) -> str | None:
    """None when the sandbox command runs here, else why not (cached per process)."""
    key = (layout.exe, layout.bwrap, net, keep_setuid)
    if key not in _PROBED:
        import tempfile

        with tempfile.TemporaryDirectory(prefix="posttrain-bwrap-probe-") as work:
            argv = command(layout, os.path.abspath(__file__), work, net=net, keep_setuid=keep_setuid)
            try:
                r = subprocess.run([*argv, layout.exe, "-I", "-S", "-c", "import os; os.listdir('.')"],
                                   capture_output=True, text=True, timeout=30, stdin=subprocess.DEVNULL)
                why = None if r.returncode == 0 else (r.stderr.strip().splitlines() or [f"exit status {r.returncode}"])[-1]
            except (OSError, subprocess.SubprocessError) as e:
                why = f"{type(e).__name__}: {e}"
        _PROBED[key] = why
    return _PROBED[key]


def isolation_for(python: str, site_packages: bool, *, net: bool, keep_setuid: bool) -> tuple[Layout | None, str | None]:
    """(layout, None) when bwrap isolates `python` here; (None, reason) otherwise."""
    bwrap = bwrap_path()
    if bwrap is None:
        return None, "bubblewrap (bwrap) is not installed"
    try:
        layout = python_layout(bwrap, python, site_packages)
    except (OSError, subprocess.SubprocessError, ValueError) as e:
        return None, f"cannot inspect the interpreter {python}: {e}"
    why = probe(layout, net=net, keep_setuid=keep_setuid)
    if why is not None:
        return None, f"{bwrap} does not run here ({why}; user namespaces not permitted?)"
    return layout, None


def notice_once(reason: str) -> None:
    """One line on stderr per process and reason (and none in processes started after it: the env flag)."""
    if reason in _NOTICED or os.environ.get("POSTTRAIN_SANDBOX_NOTICE") == reason:
        return
    _NOTICED.add(reason)
    os.environ["POSTTRAIN_SANDBOX_NOTICE"] = reason
    print(f"posttrain sandbox: no filesystem isolation: {reason}. Untrusted code can read world-readable host "
          f"files (network, rlimits, uid and audit hook still apply); {INSTALL_HINT}.", file=sys.stderr, flush=True)
