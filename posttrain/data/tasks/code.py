"""A small HumanEval-style code task (hand-written, offline): a function signature with a docstring,
asserts that test it, and a reference solution. Score with the sandboxed `code` reward.

Rows: `prompt` (one user turn asking for the function in a ```python block), `tests` (assert
statements; each one test), `entry_point`, `messages` (the prompt answered with the reference
solution, for SFT). `humaneval_mini:all` is each problem once (an evaluation set); `humaneval_mini:N`
draws N rows uniformly.
"""

from __future__ import annotations

import random

INSTRUCTION = "Complete this Python function. Reply with the whole function in a ```python code block.\n\n"

# (entry point, signature + docstring, reference body, tests)
PROBLEMS: list[tuple[str, str, str, list[str]]] = [
    ("sum_of_squares", 'def sum_of_squares(nums: list[int]) -> int:\n    """Return the sum of the squares of the numbers.\n    >>> sum_of_squares([1, 2, 3])\n    14\n    """\n',
     "    return sum(x * x for x in nums)\n",
     ["assert sum_of_squares([1, 2, 3]) == 14", "assert sum_of_squares([]) == 0", "assert sum_of_squares([-4]) == 16"]),
    ("is_palindrome", 'def is_palindrome(text: str) -> bool:\n    """True if text reads the same backwards, ignoring case and anything that is not a letter or digit.\n    >>> is_palindrome("A man, a plan, a canal: Panama")\n    True\n    """\n',
     "    t = [c.lower() for c in text if c.isalnum()]\n    return t == t[::-1]\n",
     ["assert is_palindrome('A man, a plan, a canal: Panama')", "assert not is_palindrome('abc')", "assert is_palindrome('')"]),
    ("count_vowels", 'def count_vowels(s: str) -> int:\n    """Number of vowels (a, e, i, o, u, either case) in s.\n    >>> count_vowels("Hello")\n    2\n    """\n',
     "    return sum(c in 'aeiouAEIOU' for c in s)\n",
     ["assert count_vowels('Hello') == 2", "assert count_vowels('AEIOU xyz') == 5", "assert count_vowels('') == 0"]),
    ("fizzbuzz", 'def fizzbuzz(n: int) -> list[str]:\n    """The strings for 1..n: "Fizz" for multiples of 3, "Buzz" for multiples of 5, "FizzBuzz" for both, else the number.\n    >>> fizzbuzz(5)\n    [\'1\', \'2\', \'Fizz\', \'4\', \'Buzz\']\n    """\n',
     "    return ['FizzBuzz' if i % 15 == 0 else 'Fizz' if i % 3 == 0 else 'Buzz' if i % 5 == 0 else str(i) for i in range(1, n + 1)]\n",
     ["assert fizzbuzz(5) == ['1', '2', 'Fizz', '4', 'Buzz']", "assert fizzbuzz(15)[-1] == 'FizzBuzz'", "assert fizzbuzz(0) == []"]),
    ("second_largest", 'def second_largest(nums: list[int]) -> int | None:\n    """The second largest distinct value, or None when there are fewer than two distinct values.\n    >>> second_largest([4, 1, 4, 3])\n    3\n    """\n',
     "    vals = sorted(set(nums))\n    return vals[-2] if len(vals) >= 2 else None\n",
     ["assert second_largest([4, 1, 4, 3]) == 3", "assert second_largest([7, 7]) is None", "assert second_largest([-1, -5]) == -5"]),
    ("run_length", 'def run_length(s: str) -> str:\n    """Run-length encoding: each run of a character becomes the character and the run\'s length.\n    >>> run_length("aaabcc")\n    \'a3b1c2\'\n    """\n',
     "    out, i = [], 0\n    while i < len(s):\n        j = i\n        while j < len(s) and s[j] == s[i]:\n            j += 1\n        out.append(f'{s[i]}{j - i}')\n        i = j\n    return ''.join(out)\n",
     ["assert run_length('aaabcc') == 'a3b1c2'", "assert run_length('') == ''", "assert run_length('zzzzzzzzzzzz') == 'z12'"]),
    ("flatten", 'def flatten(nested: list) -> list:\n    """All non-list items of an arbitrarily nested list, in order.\n    >>> flatten([1, [2, [3, []], 4]])\n    [1, 2, 3, 4]\n    """\n',
     "    out = []\n    for x in nested:\n        out.extend(flatten(x) if isinstance(x, list) else [x])\n    return out\n",
     ["assert flatten([1, [2, [3, []], 4]]) == [1, 2, 3, 4]", "assert flatten([]) == []", "assert flatten([[['a']], 'b']) == ['a', 'b']"]),
    ("is_prime", 'def is_prime(n: int) -> bool:\n    """True if n is a prime number.\n    >>> is_prime(7)\n    True\n    """\n',
     "    return n > 1 and all(n % d for d in range(2, int(n ** 0.5) + 1))\n",
     ["assert is_prime(7)", "assert not is_prime(1)", "assert not is_prime(91)", "assert is_prime(97)"]),
    ("word_counts", 'def word_counts(text: str) -> dict[str, int]:\n    """How often each lower-cased, whitespace-separated word occurs.\n    >>> word_counts("a B b")\n    {\'a\': 1, \'b\': 2}\n    """\n',
     "    out = {}\n    for w in text.lower().split():\n        out[w] = out.get(w, 0) + 1\n    return out\n",
     ["assert word_counts('a B b') == {'a': 1, 'b': 2}", "assert word_counts('') == {}"]),
    ("rotate_left", 'def rotate_left(xs: list, k: int) -> list:\n    """xs rotated left by k places (k may exceed the length; an empty list stays empty).\n    >>> rotate_left([1, 2, 3, 4], 1)\n    [2, 3, 4, 1]\n    """\n',
     "    if not xs:\n        return []\n    k %= len(xs)\n    return xs[k:] + xs[:k]\n",
     ["assert rotate_left([1, 2, 3, 4], 1) == [2, 3, 4, 1]", "assert rotate_left([1, 2, 3], 5) == [3, 1, 2]", "assert rotate_left([], 3) == []"]),
    ("merge_sorted", 'def merge_sorted(a: list[int], b: list[int]) -> list[int]:\n    """Merge two ascending lists into one ascending list.\n    >>> merge_sorted([1, 4], [2, 3, 5])\n    [1, 2, 3, 4, 5]\n    """\n',
     "    out, i, j = [], 0, 0\n    while i < len(a) and j < len(b):\n        if a[i] <= b[j]:\n            out.append(a[i])\n            i += 1\n        else:\n            out.append(b[j])\n            j += 1\n    return out + a[i:] + b[j:]\n",
     ["assert merge_sorted([1, 4], [2, 3, 5]) == [1, 2, 3, 4, 5]", "assert merge_sorted([], [1]) == [1]", "assert merge_sorted([2, 2], [2]) == [2, 2, 2]"]),
    ("digit_sum", 'def digit_sum(n: int) -> int:\n    """Sum of the decimal digits of n (the sign is ignored).\n    >>> digit_sum(-123)\n    6\n    """\n',
     "    return sum(int(c) for c in str(abs(n)))\n",
     ["assert digit_sum(-123) == 6", "assert digit_sum(0) == 0", "assert digit_sum(9999) == 36"]),
]


def reference(entry_point: str) -> str:
    """The reference solution (signature, docstring and body) of a problem."""
    name, head, body, _ = next(p for p in PROBLEMS if p[0] == entry_point)
    return head + body


def humaneval_mini(n: int | None, rng: random.Random) -> list[dict]:
    """n rows drawn uniformly from the problems; n=None: each problem once, in order."""
    problems = PROBLEMS if n is None else [rng.choice(PROBLEMS) for _ in range(n)]
    rows = []
    for name, head, body, tests in problems:
        question = INSTRUCTION + head
        reply = f"```python\n{head}{body}```"
        row = {"id": name} if n is None else {}  # ids are unique only when each problem appears once
        row.update({
            "messages": [{"role": "user", "content": question}, {"role": "assistant", "content": reply}],
            "prompt": [{"role": "user", "content": question}],
            "tests": list(tests),
            "entry_point": name,
        })
        rows.append(row)
    return rows
