"""Code reward: run the completion's program against the sample's tests in the sandbox (docs/rewards.md).

Columns: `tests` — a list of assert-style tests (each one test: `assert f(2) == 4`, or a block such
as HumanEval's `def check(candidate): ...\\ncheck(f)`), or one string (a single test); or `stdio` —
a list of `{"input": str, "output": str}` cases (the program reads stdin; output compared after
stripping trailing whitespace on each line). Score: 1 if every test passes, else 0; with
`partial=True` the fraction passed (partial credit is shaping: keep its weight low).

The code is the last ```python fenced block of the completion (or the last fenced block, or the
whole text). Each sample runs in a fresh sandboxed interpreter (`sandbox.Sandbox`) launched from a
pool worker, never from the trainer's process; `backend="remote"` sends it to a SandboxFusion
service instead (`remote.py`).
"""

from __future__ import annotations

import re

from posttrain.rewards.base import RewardError, completion_text, register
from posttrain.rewards.pool import default_pool
from posttrain.rewards.remote import SandboxFusionClient
from posttrain.rewards.sandbox import Limits, Sandbox, outputs_match

_FENCE = re.compile(r"```[ \t]*([A-Za-z0-9_+-]*)[^\n]*\n(.*?)```", re.S)


def extract_code(text: str) -> str:
    blocks = _FENCE.findall(text)
    if not blocks:
        return text
    py = [b for lang, b in blocks if lang.lower() in ("python", "py", "python3")]
    return (py or [b for _, b in blocks])[-1]


def run_sample(code: str, tests, stdio, limits: dict, sandbox_opts: dict, backend: str = "local",
               url: str | None = None) -> dict:
    """Worker task: {"passed", "total", "status", "isolation"}."""
    if backend == "remote":
        return SandboxFusionClient(url, timeout=limits.get("wall_s", 10.0)).run_sample(code, tests, stdio)
    sb = Sandbox(Limits(**limits), **sandbox_opts)
    if stdio is not None:
        passed, status, iso = 0, "ok", {}
        for case in stdio:
            r = sb.run_program(code, str(case.get("input", "")))
            iso = r.isolation
            ok = r.status == "ok" and r.exit_status == 0 and outputs_match(r.stdout, str(case.get("output", "")))
            passed += ok
            if not ok:
                status = r.status if r.status != "ok" else "wrong"
                break  # later cases cannot rescue an all-or-nothing score; partial counts the prefix
        return {"passed": passed, "total": len(stdio), "status": status, "isolation": iso}
    r = sb.run_tests(code, tests)
    return {"passed": r.passed, "total": r.total, "status": r.status, "isolation": r.isolation}


def make_code_reward(partial: bool = False, wall_s: float = 10.0, cpu_s: int = 10, memory_mb: int = 1024,
                     nproc: int = 32, workers: int | None = None, backend: str = "local", url: str | None = None,
                     netns: bool = True, switch_uid: bool = True, audit_hook: bool = True, site_packages: bool = False,
                     filesystem: str = "auto"):
    """Build a code reward; see the module docstring for columns and scoring. `filesystem`: "auto" (bubblewrap
    when it runs here, else a notice), "bwrap" (required), "none" (sandbox.Sandbox)."""
    if backend not in ("local", "remote"):
        raise ValueError("backend must be 'local' or 'remote'")
    if backend == "remote" and not url:
        raise ValueError("backend='remote' needs url=http://host:port")
    limits = {"wall_s": wall_s, "cpu_s": cpu_s, "memory_mb": memory_mb, "nproc": nproc}
    sb_opts = {"netns": netns, "switch_uid": switch_uid, "audit_hook": audit_hook, "site_packages": site_packages,
               "filesystem": filesystem}

    def code_reward(prompts, completions, tests=None, stdio=None, **_):
        n = len(completions)
        if tests is None and stdio is None:
            raise RewardError("code", [(None, "needs the dataset column 'tests' (asserts) or 'stdio' (cases)")])
        tests = tests if tests is not None else [None] * n
        stdio = stdio if stdio is not None else [None] * n
        scores: list[float | None] = [None] * n
        jobs, where, n_cases = [], [], []
        for i, c in enumerate(completions):
            t, s = tests[i], stdio[i]
            if t is None and s is None:
                continue
            code = extract_code(completion_text(c))
            jobs.append((code, t if s is None else None, s, limits, sb_opts, backend, url))
            where.append(i)
            n_cases.append(len(s) if s is not None else 1)
        counts = {"timeouts": 0, "crashed": 0, "passed_all": 0}
        errors = []
        if jobs:
            # the sandbox enforces wall_s per run; the pool deadline is a backstop above it
            deadline = wall_s * max(n_cases) + 15.0
            for i, out in zip(where, default_pool(workers).map(run_sample, jobs, timeout=deadline)):
                if out.timed_out:
                    scores[i] = 0.0
                    counts["timeouts"] += 1
                    continue
                if out.error:
                    errors.append((i, out.error))
                    continue
                r = out.value
                if r["status"] == "error":
                    errors.append((i, "sandbox error: " + str(r.get("detail", ""))))
                    continue
                counts["timeouts"] += r["status"] == "timeout"
                counts["crashed"] += r["status"] == "crashed"
                total = max(1, r["total"])
                full = r["passed"] == r["total"] and r["total"] > 0
                counts["passed_all"] += full
                scores[i] = r["passed"] / total if partial else float(full)
                counts["network"] = r.get("isolation", {}).get("net", "?")
                counts["filesystem"] = r.get("isolation", {}).get("fs", "?").split(" ")[0]  # bwrap | host
        code_reward.last_metrics = counts
        if errors:
            raise RewardError("code", errors, scores, samples=completions)
        return scores

    code_reward.last_metrics = {}
    return code_reward


register("code", columns=(("tests", "stdio"),), factory=make_code_reward,
         description="1 if the program passes all `tests` (asserts) or `stdio` cases in the sandbox, else 0")(make_code_reward())
register("code_partial", columns=(("tests", "stdio"),),
         description="fraction of `tests` / `stdio` cases passed in the sandbox")(make_code_reward(partial=True))
