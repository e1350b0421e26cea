"""Client for a SandboxFusion-compatible code execution service (ByteDance SandboxFusion, 2024).

    POST {url}/run_code  {"code", "language": "python", "run_timeout", "compile_timeout", "stdin", "files": {}}
    -> {"status": "Success" | "Failed" | "SandboxError", "message",
        "run_result": {"status": "Finished" | "TimeLimitExceeded" | "Error", "execution_time",
                       "return_code", "stdout", "stderr"}, ...}

Isolation is the service's job. The sentinel here is weaker than the local harness's (the token
travels inside the script, which the program could read), so each test prints its own random token
only after its last assert; early exits and swallowed failures still cannot produce it. Prefer the
local sandbox where a policy is adversarial and the machine allows it.
"""

from __future__ import annotations

import json
import secrets
import urllib.error
import urllib.request

from posttrain.rewards.sandbox import outputs_match


class SandboxFusionClient:
    def __init__(self, url: str, timeout: float = 10.0, language: str = "python", retries: int = 2):
        self.url = url.rstrip("/")
        self.timeout, self.language, self.retries = timeout, language, retries

    def run_code(self, code: str, stdin: str = "") -> dict:
        body = json.dumps({"code": code, "language": self.language, "run_timeout": self.timeout,
                           "compile_timeout": self.timeout, "stdin": stdin, "files": {}}).encode()
        last: Exception | None = None
        for _ in range(self.retries + 1):
            req = urllib.request.Request(self.url + "/run_code", data=body, headers={"Content-Type": "application/json"})
            try:
                with urllib.request.urlopen(req, timeout=self.timeout + 10) as resp:
                    return json.loads(resp.read(4 << 20))
            except (urllib.error.URLError, TimeoutError, ConnectionError, json.JSONDecodeError) as e:
                last = e
        raise ConnectionError(f"sandbox service {self.url} unreachable: {last}")

    def run_sample(self, code: str, tests, stdio) -> dict:
        """Same result shape as code.run_sample: {"passed", "total", "status", "isolation"}."""
        iso = {"net": "remote", "service": self.url}
        if stdio is not None:
            passed = 0
            for case in stdio:
                res = self.run_code(code, str(case.get("input", "")))
                rr = res.get("run_result") or {}
                ok = (res.get("status") == "Success" and rr.get("return_code") == 0
                      and outputs_match(rr.get("stdout", ""), str(case.get("output", ""))))
                if not ok:
                    status = "timeout" if rr.get("status") == "TimeLimitExceeded" else "wrong"
                    return {"passed": passed, "total": len(stdio), "status": status, "isolation": iso}
                passed += 1
            return {"passed": passed, "total": len(stdio), "status": "ok", "isolation": iso}
        tests = [tests] if isinstance(tests, str) else list(tests)
        tokens = [secrets.token_hex(16) for _ in tests]
        parts = [code, "\nimport sys as _pt_sys, builtins as _pt_b\n"]
        for t, tok in zip(tests, tokens):
            body = "\n".join("    " + line for line in t.splitlines()) or "    pass"
            parts.append(f"try:\n{body}\n    _pt_b.print({tok!r}, flush=True)\nexcept BaseException:\n    pass\n")
        res = self.run_code("".join(parts))
        rr = res.get("run_result") or {}
        lines = set((rr.get("stdout") or "").split())
        passed = sum(tok in lines for tok in tokens)
        status = "timeout" if rr.get("status") == "TimeLimitExceeded" else ("ok" if res.get("status") in ("Success", "Failed") else "error")
        return {"passed": passed, "total": len(tests), "status": status, "isolation": iso,
                "detail": res.get("message", "")}
