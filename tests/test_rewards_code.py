"""Code reward: correct reference solutions score 1, incorrect ones 0; stdio; remote client."""

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from posttrain.rewards.code import extract_code, make_code_reward
from posttrain.rewards.pool import default_pool

pytestmark = pytest.mark.timeout(120)

# name: (correct, incorrect, tests)
PROBLEMS = {
    "add": ("def add(a, b):\n    return a + b", "def add(a, b):\n    return a - b", ["assert add(2, 3) == 5", "assert add(-1, 1) == 0"]),
    "reverse": ("def rev(s):\n    return s[::-1]", "def rev(s):\n    return s", ["assert rev('abc') == 'cba'", "assert rev('') == ''"]),
    "fib": ("def fib(n):\n    a, b = 0, 1\n    for _ in range(n): a, b = b, a + b\n    return a",
            "def fib(n):\n    return n", ["assert fib(0) == 0", "assert fib(10) == 55", "assert fib(1) == 1"]),
    "is_prime": ("def is_prime(n):\n    return n > 1 and all(n % d for d in range(2, int(n**0.5) + 1))",
                 "def is_prime(n):\n    return n % 2 == 1", ["assert is_prime(2)", "assert not is_prime(9)", "assert is_prime(97)"]),
    "max_list": ("def mx(xs):\n    return max(xs)", "def mx(xs):\n    return xs[0]", ["assert mx([1, 5, 3]) == 5", "assert mx([-2, -1]) == -1"]),
    "palindrome": ("def pal(s):\n    t = ''.join(c.lower() for c in s if c.isalnum())\n    return t == t[::-1]",
                   "def pal(s):\n    return s == s[::-1]", ["assert pal('A man, a plan, a canal: Panama')", "assert not pal('abc')"]),
    "factorial": ("def fact(n):\n    r = 1\n    for i in range(2, n + 1): r *= i\n    return r",
                  "def fact(n):\n    return n * (n - 1)", ["assert fact(0) == 1", "assert fact(5) == 120"]),
    "gcd": ("def gcd(a, b):\n    while b: a, b = b, a % b\n    return a", "def gcd(a, b):\n    return min(a, b)",
            ["assert gcd(12, 18) == 6", "assert gcd(7, 3) == 1"]),
    "sort_desc": ("def sd(xs):\n    return sorted(xs, reverse=True)", "def sd(xs):\n    return sorted(xs)", ["assert sd([3, 1, 2]) == [3, 2, 1]"]),
    "count_vowels": ("def cv(s):\n    return sum(c in 'aeiouAEIOU' for c in s)", "def cv(s):\n    return sum(c in 'aeiou' for c in s)",
                     ["assert cv('hello') == 2", "assert cv('AEIOU') == 5"]),
    "flatten": ("def flat(xs):\n    out = []\n    for x in xs:\n        out.extend(flat(x) if isinstance(x, list) else [x])\n    return out",
                "def flat(xs):\n    return [y for x in xs for y in (x if isinstance(x, list) else [x])]",
                ["assert flat([1, [2, [3, [4]]]]) == [1, 2, 3, 4]"]),
    "two_sum": ("def two_sum(xs, t):\n    seen = {}\n    for i, x in enumerate(xs):\n        if t - x in seen: return [seen[t - x], i]\n        seen[x] = i",
                "def two_sum(xs, t):\n    return [0, 1]", ["assert two_sum([2, 7, 11, 15], 9) == [0, 1]", "assert two_sum([3, 2, 4], 6) == [1, 2]"]),
    "word_count": ("from collections import Counter\ndef wc(s):\n    return dict(Counter(s.split()))",
                   "def wc(s):\n    return {w: 1 for w in s.split()}", ["assert wc('a b a') == {'a': 2, 'b': 1}"]),
    "unique_sorted": ("def us(xs):\n    return sorted(set(xs))", "def us(xs):\n    return list(dict.fromkeys(xs))", ["assert us([3, 1, 3, 2]) == [1, 2, 3]"]),
    "binary": ("def to_bin(n):\n    return bin(n)[2:]", "def to_bin(n):\n    return bin(n)", ["assert to_bin(5) == '101'", "assert to_bin(0) == '0'"]),
    "matrix_transpose": ("def tr(m):\n    return [list(r) for r in zip(*m)]", "def tr(m):\n    return m",
                         ["assert tr([[1, 2], [3, 4]]) == [[1, 3], [2, 4]]"]),
    "anagram": ("def ana(a, b):\n    return sorted(a) == sorted(b)", "def ana(a, b):\n    return set(a) == set(b)",
                ["assert ana('listen', 'silent')", "assert not ana('aab', 'abb')"]),
    "mean": ("def mean(xs):\n    return sum(xs) / len(xs)", "def mean(xs):\n    return sum(xs) // len(xs)",
             ["assert abs(mean([1, 2]) - 1.5) < 1e-9"]),
    "roman": ("def roman(n):\n    vals = [(1000,'M'),(900,'CM'),(500,'D'),(400,'CD'),(100,'C'),(90,'XC'),(50,'L'),(40,'XL'),(10,'X'),(9,'IX'),(5,'V'),(4,'IV'),(1,'I')]\n"
              "    out = ''\n    for v, s in vals:\n        while n >= v: out += s; n -= v\n    return out",
              "def roman(n):\n    return 'I' * n", ["assert roman(1994) == 'MCMXCIV'", "assert roman(3) == 'III'"]),
    "humaneval_style": ("def has_close(xs, t):\n    return any(abs(a - b) < t for i, a in enumerate(xs) for b in xs[i + 1:])",
                        "def has_close(xs, t):\n    return False",
                        ["def check(candidate):\n    assert candidate([1.0, 2.8, 3.0], 0.3) == True\n    assert candidate([1.0, 2.0], 0.5) == False\ncheck(has_close)"]),
    "rotate": ("def rot(xs, k):\n    k %= len(xs)\n    return xs[-k:] + xs[:-k]", "def rot(xs, k):\n    return xs[k:] + xs[:k]",
               ["assert rot([1, 2, 3, 4], 1) == [4, 1, 2, 3]"]),
}


@pytest.fixture(scope="module")
def reward():
    default_pool(2)
    return make_code_reward(wall_s=5.0)


def test_reference_solutions(reward):
    names = sorted(PROBLEMS)
    assert len(names) >= 20
    comps = [f"Here you go:\n```python\n{PROBLEMS[n][0]}\n```" for n in names] + [PROBLEMS[n][1] for n in names]
    tests = [PROBLEMS[n][2] for n in names] * 2
    scores = reward([""] * len(comps), comps, tests=tests)
    got = dict(zip([f"{n}/correct" for n in names] + [f"{n}/incorrect" for n in names], scores))
    want = {**{f"{n}/correct": 1.0 for n in names}, **{f"{n}/incorrect": 0.0 for n in names}}
    assert got == want


def test_partial_credit_and_stdio():
    r = make_code_reward(partial=True, wall_s=5.0)
    tests = ["assert f(1) == 1", "assert f(2) == 4", "assert f(3) == 9", "assert f(4) == 15"]
    assert r(["p"], ["def f(x): return x * x"], tests=[tests]) == [0.75]
    stdio = [{"input": "2 3\n", "output": "5\n"}, {"input": "10 -4\n", "output": "6"}]
    good, bad = "a, b = map(int, input().split())\nprint(a + b)", "print(5)"
    full = make_code_reward(wall_s=5.0)
    assert full(["p", "p"], [good, bad], stdio=[stdio, stdio]) == [1.0, 0.0]
    assert full(["p"], ["x"], tests=[None]) == [None]


def test_extract_code():
    assert extract_code("a\n```js\nx\n```\n```python\ny = 1\n```\n") == "y = 1\n"
    assert extract_code("no fences") == "no fences"


class _FakeSandboxFusion(BaseHTTPRequestHandler):
    """Executes nothing: answers like SandboxFusion by pattern-matching a tiny language."""
    calls = []

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        _FakeSandboxFusion.calls.append(body)
        import contextlib
        import io

        out = io.StringIO()
        status, rc = "Finished", 0
        try:  # the fake really runs the code, in-process: it is a test double for trusted snippets only
            with contextlib.redirect_stdout(out):
                exec(body["code"], {"__name__": "__main__", "input": lambda: body.get("stdin", "").splitlines()[0]})
        except SystemExit:
            pass
        except Exception:
            rc = 1
        payload = {"status": "Success" if rc == 0 else "Failed", "message": "",
                   "run_result": {"status": status, "execution_time": 0.01, "return_code": rc, "stdout": out.getvalue(), "stderr": ""}}
        data = json.dumps(payload).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *a):
        pass


def test_remote_sandboxfusion_client_over_real_http():
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _FakeSandboxFusion)
    th = threading.Thread(target=srv.serve_forever, daemon=True)
    th.start()
    try:
        from posttrain.rewards.remote import SandboxFusionClient

        url = f"http://127.0.0.1:{srv.server_address[1]}"
        c = SandboxFusionClient(url, timeout=5)
        res = c.run_sample("def f(x): return 2 * x", ["assert f(2) == 4", "assert f(3) == 7"], None)
        assert (res["passed"], res["total"], res["isolation"]["net"]) == (1, 2, "remote")
        body = _FakeSandboxFusion.calls[-1]
        assert body["language"] == "python" and body["run_timeout"] == 5
        res = c.run_sample("import sys\nsys.exit(0)", ["assert f(2) == 4"], None)
        assert res["passed"] == 0  # an early exit prints no token
        res = c.run_sample("print(int(input()) + 1)", None, [{"input": "41\n", "output": "42"}])
        assert res["passed"] == 1 and res["status"] == "ok"
        reward = make_code_reward(backend="remote", url=url, wall_s=5.0)
        assert reward(["p", "p"], ["def f(x): return 2 * x", "def f(x): return x"], tests=[["assert f(2) == 4"]] * 2) == [1.0, 0.0]
    finally:
        srv.shutdown()
        srv.server_close()
