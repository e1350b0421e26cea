"""In-sandbox harness: `python -I -S -B _harness.py IN_FD RESULT_FD` (started by sandbox.py).

Runs with no project imports (the sandbox interpreter may be a different Python). Order matters:

1. read the job (token, code, tests, limits) from IN_FD and close it — the tests and the token
   never exist on the sandbox's filesystem;
2. compile the tests *before* any untrusted code runs (AST pass: `assert a == b` -> strict equality,
   so an object whose `__eq__` always returns True cannot pass);
3. isolate: network namespace (unshare CLONE_NEWNET as root; CLONE_NEWUSER|CLONE_NEWNET otherwise; already
   done when bubblewrap started us, which also hides the host's files: rewards/bwrap.py),
   PR_SET_NO_NEW_PRIVS, drop to the sandbox uid (root only), rlimits (CPU, AS, FSIZE, NOFILE, NPROC, CORE);
4. install an audit hook (PEP 578) that refuses process creation, sockets, ctypes, frame and gc
   introspection, signals to other processes, and writes outside the work dir;
5. run the solution, restore builtins / pre-loaded modules / timers it may have patched, then run
   each test in a fresh namespace. The sentinel: test i's code ends with a statement that writes
   `TOKEN_i\\tT\\ti\\t1`, where TOKEN_i is a random per-test token the parent generated and that
   exists only as a constant inside test i's code object. It is written only if control reaches
   the end of the test, i.e. after its last assert, so `os._exit(0)`, `sys.exit(0)`, swallowed
   exceptions, patched `unittest`/builtins or signal tricks produce no pass line.

Why the untrusted code cannot find the tokens: all of it (solution and tests) runs in threads
(`_run_in_thread`), so no frame of the main thread is on its stack, and the thread body holds the
code object only on its value stack, not in a local; the main thread, which holds the tokens, is
unreachable (sys._current_frames and gc are refused by the audit hook, and signal handlers can
only be installed from the main thread); code objects are reachable only through `f_code` /
`gi_code` / `cr_code`, which the audit hook refuses. A token learnt by intercepting test i's own
write (after it passed) says nothing about test j's. Lines without a valid token are ignored.
"""

import ast
import builtins
import json
import os
import signal
import sys

_write = os.write
_exit = os._exit


# C901: one closure on purpose. A helper at module level would be a global the solution can patch
# (`import __main__`); every name `_strict_eq` calls is bound here, before untrusted code runs.
def _make_strict_eq(type=type, len=len, all=all, zip=zip, bool=bool, int=int, float=float, complex=complex,  # noqa: C901
                    str=str, bytes=bytes, bytearray=bytearray, list=list, tuple=tuple, dict=dict, set=set,
                    frozenset=frozenset):
    """Build `_strict_eq` with every name it uses bound now, so later patches to builtins or to
    this module cannot change it."""

    def _strict_eq(a, b, _depth=0):  # noqa: C901 - see _make_strict_eq
        """`a == b`, refusing objects of user classes that hijack equality (Python data model).

        Builtin values compare with their own semantics (1 == 1.0 is allowed; bool/int/float/complex
        are one numeric family); containers compare element-wise by this same rule; instances of
        classes defined outside the standard library fall back to `==` only when both sides have
        exactly the same type.
        """
        if _depth > 50:
            return a == b
        num = (bool, int, float, complex)
        ta, tb = type(a), type(b)
        if ta in num and tb in num:
            return a == b
        if ta in (str, bytes, type(None), bytearray) or tb in (str, bytes, type(None), bytearray):
            return ta is tb and a == b
        if ta in (list, tuple) or tb in (list, tuple):
            if ta is not tb or len(a) != len(b):
                return False
            return all(_strict_eq(x, y, _depth + 1) for x, y in zip(a, b))
        if ta is dict or tb is dict:
            if ta is not tb or len(a) != len(b):
                return False
            for k, v in a.items():
                if type(k) not in (str, int, float, bool, tuple, bytes, type(None), frozenset):
                    return False
                if k not in b or not _strict_eq(v, b[k], _depth + 1):
                    return False
            return True
        if ta in (set, frozenset) or tb in (set, frozenset):
            if not (ta in (set, frozenset) and tb in (set, frozenset)):
                return False
            safe = (str, int, float, bool, tuple, bytes, type(None), frozenset)
            if not all(type(x) in safe for x in a) or not all(type(x) in safe for x in b):
                return False
            return a == b
        if ta is not tb:  # e.g. an AlwaysEqual instance compared with an int
            return False
        return a == b

    return _strict_eq


class _StrictAsserts(ast.NodeTransformer):
    """`assert X == Y` -> `assert __pt_eq__(X, Y)` (also `!=`)."""

    def visit_Assert(self, node):
        t = node.test
        if isinstance(t, ast.Compare) and len(t.ops) == 1 and isinstance(t.ops[0], (ast.Eq, ast.NotEq)):
            call = ast.Call(func=ast.Name("__pt_eq__", ast.Load()), args=[t.left, t.comparators[0]], keywords=[])
            test = call if isinstance(t.ops[0], ast.Eq) else ast.UnaryOp(ast.Not(), call)
            node = ast.Assert(test=test, msg=node.msg)
        return self.generic_visit(node)


def _libc():
    import ctypes

    return ctypes.CDLL(None, use_errno=True)


def _isolate(job, libc):
    """Network namespace, no-new-privs, uid drop, rlimits. Returns what was achieved."""
    import resource

    iso = {"net": "none", "uid": os.getuid(), "nproc": "rlimit"}
    CLONE_NEWNET, CLONE_NEWUSER = 0x40000000, 0x10000000
    if job.get("netns_done"):  # bubblewrap started us in a fresh network namespace (bwrap.py)
        iso["net"] = "netns"
    elif job.get("netns", True):
        flags = CLONE_NEWNET if os.geteuid() == 0 else CLONE_NEWUSER | CLONE_NEWNET
        if libc.unshare(flags) == 0:
            iso["net"] = "netns"
    libc.prctl(38, 1, 0, 0, 0)  # PR_SET_NO_NEW_PRIVS: setuid binaries gain nothing
    uid = job.get("uid")
    if uid is not None and os.geteuid() == 0:
        os.setgroups([])
        os.setgid(uid)
        os.setuid(uid)
        iso["uid"] = uid
    lim = job["limits"]
    mb = 1024 * 1024
    nproc = lim["nproc"]
    if os.getuid() != 0 and uid is None:  # shared uid: the cap is on top of what the user already runs
        nproc += job["nproc_base"] if "nproc_base" in job else _count_procs(os.getuid())
    for res, val in (
        (resource.RLIMIT_CPU, lim["cpu_s"]),
        (resource.RLIMIT_AS, lim["memory_mb"] * mb),
        (resource.RLIMIT_FSIZE, lim["fsize_mb"] * mb),
        (resource.RLIMIT_NOFILE, lim["nofile"]),
        (resource.RLIMIT_NPROC, nproc),
        (resource.RLIMIT_CORE, 0),
    ):
        try:
            resource.setrlimit(res, (val, val))
        except (ValueError, OSError):
            iso.setdefault("rlimit_failed", []).append(res)
    if os.getuid() == 0:
        iso["nproc"] = "none (root is exempt from RLIMIT_NPROC)"
    return iso


def _count_procs(uid):
    n = 0
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                with open(f"/proc/{pid}/status") as f:
                    for line in f:
                        if line.startswith("Uid:"):
                            n += int(line.split()[1]) == uid
                            break
            except OSError:
                pass
    return n


# frames lead to namespaces and code objects (which hold the test tokens)
_CODE_ATTRS = frozenset({"f_code", "gi_code", "cr_code", "ag_code", "tb_frame", "gi_frame", "cr_frame", "ag_frame"})
_SPAWN = ("os.fork", "os.forkpty", "os.posix_spawn", "os.spawn", "os.exec", "os.system", "subprocess.Popen", "pty.spawn")
_INTROSPECT = ("sys._current_frames", "sys.settrace", "sys.setprofile", "gc.get_objects",
               "gc.get_referrers", "gc.get_referents", "threading.settrace", "threading.setprofile")
_PATH_EVENTS = ("os.remove", "os.rename", "os.rmdir", "os.mkdir", "os.chmod", "os.chown", "os.link",
                "os.symlink", "os.truncate", "os.utime", "shutil.rmtree", "shutil.copyfile", "shutil.move")


# C901: one flat dispatch on the audit event, kept in one closure like _make_strict_eq: module-level helpers
# would be more globals the solution could patch (`import __main__`).
def _make_hook(workdir, allow_spawn, *, isinstance=isinstance, len=len, str=str, any=any, bytes=bytes, int=int,  # noqa: C901
               Exception=Exception, PermissionError=PermissionError, ValueError=ValueError, spawn=_SPAWN,
               introspect=_INTROSPECT, code_attrs=_CODE_ATTRS, path_events=_PATH_EVENTS,
               realpath=os.path.realpath, fspath=os.fspath, getpid=os.getpid, sep=os.sep,
               write_flags=os.O_WRONLY | os.O_RDWR | os.O_CREAT):
    """The audit hook, with every name it uses bound now (like `_make_strict_eq`): a solution that
    rebinds this module's globals (`import __main__; __main__._SPAWN = ()`), `os.*` or builtins
    cannot change what the hook refuses."""
    prefix = realpath(workdir) + sep

    def inside(p):
        try:
            p = fspath(p)
            if isinstance(p, bytes):
                p = p.decode("utf-8", "replace")
            if isinstance(p, int):
                return True
            return (realpath(p) + sep).startswith(prefix)
        except Exception:
            return False

    def hook(event, args):
        if event == "open":
            path, mode, flags = args
            if isinstance(path, int):
                return
            p = fspath(path) if not isinstance(path, (str, bytes)) else path
            p = p.decode("utf-8", "replace") if isinstance(p, bytes) else p
            if p.startswith("/proc") and not p.startswith(("/proc/self/stat", "/proc/self/maps")):
                raise PermissionError(f"sandbox: reading {p} is not allowed")
            writing = (mode and any(c in str(mode) for c in "wax+")) or (flags & write_flags)
            if writing and not inside(p):
                raise PermissionError(f"sandbox: writing outside the work dir is not allowed: {p}")
        elif event == "sys._getframe":  # the stdlib callers (namedtuple, enum, typing) catch ValueError
            raise ValueError("sandbox: frame introspection is not available")
        elif event.startswith(("socket.", "ctypes.", "_ctypes.")) or event in introspect:
            raise PermissionError(f"sandbox: {event} is not allowed")
        elif event.startswith(spawn) and not allow_spawn:
            raise PermissionError(f"sandbox: {event} is not allowed")
        elif event in ("os.kill", "os.killpg", "signal.pthread_kill"):
            if event != "os.kill" or args[0] not in (0, getpid()):
                raise PermissionError(f"sandbox: {event} to another process is not allowed")
        elif event == "object.__getattr__" and len(args) > 1 and args[1] in code_attrs:
            raise PermissionError(f"sandbox: reading {args[1]} is not allowed")
        elif event == "object.__setattr__" and len(args) > 1 and args[1] in ("__code__",):
            raise PermissionError("sandbox: replacing code objects is not allowed")
        elif event in path_events and args and not inside(args[0]):
            raise PermissionError(f"sandbox: {event} outside the work dir is not allowed")

    return hook



def _runner(box, lock):
    """Thread body. The callable (functools.partial(exec, code, ns)) is popped and called in one
    expression, so it lives only on this frame's value stack, never in f_locals: a solution that
    walks up to this frame finds neither the code object nor its token."""
    try:
        box.pop()()
    except BaseException as e:
        try:
            _write(2, f"{type(e).__name__}: {str(e)[:300]}\n".encode("utf-8", "replace"))
        except BaseException:
            pass
    finally:
        lock.release()


def _make_runtime(modules_snap, builtins_snap):
    """Closures used after untrusted code has run. Everything they call is bound here, before the
    solution starts: a solution can patch builtins, this module's globals (`import __main__`) or
    `functools`, but not the cells of these closures."""
    import _thread
    from functools import partial

    start, alloc, runner, exec_ = _thread.start_new_thread, _thread.allocate_lock, _runner, exec
    bd, getattr_, list_ = builtins.__dict__, getattr, list
    modules, setitimer = sys.modules, signal.setitimer
    timers = (signal.ITIMER_REAL, signal.ITIMER_VIRTUAL, signal.ITIMER_PROF)

    def run_in_thread(code, ns):
        """Run untrusted code off the main thread and wait (the wall timeout bounds the wait).
        Releasing the lock early only makes the next test start sooner: passes need tokens."""
        lock = alloc()
        lock.acquire()
        start(runner, ([partial(exec_, code, ns)], lock))
        lock.acquire()

    def restore():
        """Undo global patches: builtins first (with bound methods only), then the dicts of the
        modules loaded before the solution (this one included), drop modules it imported, timers."""
        for k in [k for k in bd if k not in builtins_snap]:
            del bd[k]
        bd.update(builtins_snap)
        for name in list_(modules):
            if name not in modules_snap:
                del modules[name]
        for name, (m, d) in modules_snap.items():
            modules[name] = m
            md = getattr_(m, "__dict__", None)
            if md is None:
                continue
            for k in [k for k in md if k not in d]:
                del md[k]
            for k, v in d.items():
                if md.get(k) is not v:
                    md[k] = v
        for t in timers:
            setitimer(t, 0)

    return run_in_thread, restore


def _compact_unraisable(u):
    try:
        _write(2, f"{getattr(u.exc_type, '__name__', u.exc_type)}: {str(u.exc_value)[:300]}\n".encode("utf-8", "replace"))
    except BaseException:
        pass


def main():
    in_fd, res_fd = int(sys.argv[1]), int(sys.argv[2])
    chunks = []
    while True:
        b = os.read(in_fd, 1 << 20)
        if not b:
            break
        chunks.append(b)
    os.close(in_fd)
    job = json.loads(b"".join(chunks))
    token = job.pop("token")
    test_tokens = job.pop("test_tokens")
    del chunks

    def emit(*fields, _w=_write, _s=str):
        _w(res_fd, ("\t".join([token] + [_s(f) for f in fields]) + "\n").encode())

    # compile the tests before any untrusted code can touch `compile` or `ast`; each ends with its
    # own token-signed pass line (see the module docstring)
    tests = []
    for i, src in enumerate(job.get("tests") or []):
        tree = _StrictAsserts().visit(ast.parse(src, f"test_{i}.py"))
        line = f"{test_tokens[i]}\tT\t{i}\t1\n".encode()
        tree.body.append(ast.Expr(ast.Call(ast.Name("__pt_w__", ast.Load()),
                                           [ast.Name("__pt_fd__", ast.Load()), ast.Constant(line)], [])))
        tests.append(compile(ast.fix_missing_locations(tree), f"test_{i}.py", "exec"))
    del test_tokens
    solution = compile(job["code"], "solution.py", "exec")
    mode = job["mode"]
    libc = _libc()
    iso = _isolate(job, libc)
    os.chdir(job["workdir"])
    sys.unraisablehook = _compact_unraisable
    builtins_snap = dict(builtins.__dict__)
    modules_snap = {name: (m, dict(getattr(m, "__dict__", {}))) for name, m in list(sys.modules.items())}
    iso["audit"] = bool(job.get("audit", True))
    emit("ISO", json.dumps(iso))
    excepthook, write, strict_eq = sys.__excepthook__, _write, _make_strict_eq()
    run_in_thread, restore = _make_runtime(modules_snap, builtins_snap)
    if iso["audit"]:
        sys.addaudithook(_make_hook(job["workdir"], job.get("allow_spawn", False)))

    if mode == "program":  # stdin/stdout test: the parent compares the output
        status = 0
        try:
            exec(solution, {"__name__": "__main__", "__builtins__": builtins})
        except SystemExit as e:
            status = 0 if e.code in (None, 0) else 1
        except BaseException as e:
            excepthook(type(e), e, e.__traceback__)
            status = 1
        try:
            sys.stdout.flush()
        except Exception:
            status = 1
        emit("EXIT", status)
        _exit(0)

    # assert-style tests: untrusted code only ever runs in threads (see the module docstring)
    ns = {"__name__": "solution", "__builtins__": builtins}
    run_in_thread(solution, ns)
    restore()
    base = {k: v for k, v in ns.items() if not k.startswith("__") and k not in builtins_snap}
    for code in tests:
        test_ns = dict(base, __name__="tests", __builtins__=dict(builtins_snap), __pt_eq__=strict_eq,
                       __pt_w__=write, __pt_fd__=res_fd)
        run_in_thread(code, test_ns)
        restore()
    emit("DONE", len(tests))
    _exit(0)


if __name__ == "__main__":
    main()
