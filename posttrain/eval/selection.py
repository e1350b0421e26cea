"""`posttrain eval select=best_of_n|majority`: the accuracy of the answer a test-time selection keeps, and its cost.

For every k of `k=` (and n), the selection looks at the first k samples of each problem (what a user drawing k
samples would get; rollout/select.py's tie rules) and the kept sample's verdict is the problem's value of
`bon@k` (best_of_n) or `maj@k` (majority): 0 or 1, so the benchmark value is an accuracy and its interval is
Wilson's over the problems (results.summarize). The cost is every generated token of those k samples
(`tokens@k`, per problem and in total): selection pays for all of them.

best_of_n ranks by `select_reward` ('' = the evaluation's own verifier: it reads the reference, so bon@k is then
an oracle, equal to pass@k measured on the first k samples). majority votes with the verifier's extraction
(the classes cons@k uses); maj@k differs from cons@k only in that it takes the first k samples and breaks ties
by the first class rather than averaging every k-subset and scoring a tie by its expected value.
"""

from __future__ import annotations

from posttrain.eval.runner import ItemResult
from posttrain.rollout.select import best_index, majority_index

PREFIX = {"best_of_n": "bon", "majority": "maj"}


def kept_index(method: str, r: ItemResult, k: int, rewards: list | None) -> int:
    """The index the selection keeps among the first k samples of one problem."""
    if method == "best_of_n":
        return best_index(list(rewards if rewards is not None else [s.score for s in r.samples])[:k])
    return majority_index(list(r.classes or [None] * len(r.samples))[:k])[0]


def selection_values(method: str, results: list[ItemResult], ks: list[int], rewards: list | None = None):
    """-> (per problem {"bon@k" | "maj@k": the kept sample's verdict 0/1}, per problem {"selected": {k: kept index},
    "tokens": {k: tokens of the first k samples}}); `rewards[i]`: the selection reward of problem i's samples
    (None: the verifier's)."""
    values, records = [], []
    for i, r in enumerate(results):
        val, rec = {}, {"selected": {}, "tokens": {}}
        for k in ks:
            if r.error or not r.samples:
                val[f"{PREFIX[method]}@{k}"], rec["tokens"][str(k)] = 0.0, 0
                continue
            j = kept_index(method, r, k, None if rewards is None else rewards[i])
            rec["selected"][str(k)] = j
            val[f"{PREFIX[method]}@{k}"] = float(r.samples[j].correct)
            rec["tokens"][str(k)] = sum(s.tokens for s in r.samples[:k])
        values.append(val)
        records.append(rec)
    return values, records


def selection_report(method: str, describe: str, oracle: bool, records: list[dict], summary: dict, ks: list[int]) -> dict:
    """results.json's `selection`: method, what ranks, oracle flag, and per k the accuracy with its interval and cost."""
    m = len(records)
    rows = []
    for k in ks:
        tokens = sum(v["tokens"][str(k)] for v in records)
        rows.append({"k": k, "accuracy": summary[f"{PREFIX[method]}@{k}"], "generated_tokens": tokens,
                     "tokens_per_problem": tokens / m if m else 0.0})
    return {"method": method, "metric": PREFIX[method], "by": describe, "oracle": oracle, "per_k": rows}


def print_selection(sel: dict, pct: int) -> None:
    print(f"selection: {sel['by']}")
    for row in sel["per_k"]:
        a = row["accuracy"]
        print(f"  {sel['metric']}@{row['k']:<4} {a['value']:.4f}  [{a['low']:.4f}, {a['high']:.4f}] {pct}%  "
              f"cost {row['tokens_per_problem']:.1f} generated tokens per problem ({row['generated_tokens']} in all)")
    if sel["oracle"]:
        print("  (oracle: the ranking reward saw the reference answer; this is an upper bound like pass@k, not a method)")


class EvalSelection:
    """What `posttrain eval select=…` adds, checked before the model loads (`prepare`) and applied to the scored
    samples (`apply`): bon@k / maj@k per problem, their cost, and results.json's `selection`."""

    def __init__(self, cfg, items, reward_fn, ex: dict | None, pool=None):
        from posttrain.errors import UserError
        from posttrain.rollout.select import Selector

        self.method, self.ks = cfg.select, cfg.ks
        self.selector = None
        if self.method == "majority" and ex is None:
            raise UserError(f"select=majority votes on the final answer the math verifier extracts, and reward='{cfg.reward}' "
                            "has no math verifier (math, math_answer_tag, math_after_think); use select=best_of_n")
        if self.method == "best_of_n" and cfg.select_reward:
            self.selector = Selector("best_of_n", cfg.select_reward, cfg.reward_args, pool, cfg.n)
            self.selector.check_rows([it.data for it in items], cfg.data)
            self.oracle, self.describe = self.selector.oracle, self.selector.describe()
        elif self.method == "best_of_n":
            self.oracle = True  # the verifier scores against the reference
            self.describe = (f"best_of_n by the verifier ({cfg.reward or 'the default verifier'}), which reads the reference: "
                             "an ORACLE, pass@k-like (select_reward=rm:PATH or select=majority for a non-oracle choice)")
        else:
            self.oracle, self.describe = False, "majority vote on the verifier's extracted final answer (needs no reference)"

    def apply(self, results: list[ItemResult], values: list[dict]) -> list[dict]:
        """Adds bon@k | maj@k to each problem's `values` (in place); returns the per-problem records."""
        rewards = None
        if self.selector is not None:
            groups = [(r.item.data["prompt"], r.item.data, [s.text for s in r.samples], [[] for _ in r.samples]) for r in results]
            rewards = self.selector.rewards(groups)
        vals, self.records = selection_values(self.method, results, self.ks, rewards)
        for v, extra in zip(values, vals):
            v.update(extra)
        return self.records

    def report(self, summary: dict) -> dict:
        return selection_report(self.method, self.describe, self.oracle, self.records, summary, self.ks)


# ---------------------------------------------------------------- two models at equal generated tokens

BUDGETS = (10, 20, 40, 80, 160, 320)


def within(tokens: list[int], budget: int) -> int:
    """How many samples, taken in order, fit in `budget` tokens (at least one)."""
    used = m = 0
    for t in tokens:
        if m and used + t > budget:
            break
        used, m = used + t, m + 1
    return m


def at_budget(doc: dict, budget: int, orders: int = 500, seed: int = 0) -> list[dict]:
    """Per problem of an eval results doc, the mean over `orders` seeded random orders of its n samples (draws are
    exchangeable, so this is the expected value of sampling until the budget is spent; one order alone is noisy):
    samples used `m`, `tokens` spent, and the verdicts of the answers best-of-N by the verifier (`bon`, an oracle)
    and majority (`maj`) keep. Needs the samples' tokens, scores and answer classes (eval with a math verifier)."""
    import random

    rng = random.Random(seed)
    rows = []
    for it in doc["items"]:
        n = len(it.get("samples") or [])
        if not n or "classes" not in it:
            raise ValueError(f"problem {it.get('id')!r}: no samples or answer classes (needs save_samples and a math verifier)")
        acc = {"m": 0.0, "tokens": 0.0, "bon": 0.0, "maj": 0.0}
        for _ in range(orders):
            perm = rng.sample(range(n), n)
            toks = [it["samples"][j]["tokens"] for j in perm]
            pick = perm[:within(toks, budget)]
            acc["m"] += len(pick)
            acc["tokens"] += sum(toks[:len(pick)])
            acc["bon"] += it["correct"][pick[best_index([it["scores"][j] for j in pick])]]
            acc["maj"] += it["correct"][pick[majority_index([it["classes"][j] for j in pick])[0]]]
        rows.append({k: v / orders for k, v in acc.items()})
    return rows


def equal_tokens(a: dict, b: dict, budgets=BUDGETS, orders: int = 500, seed: int = 0, confidence: float = 0.95) -> dict:
    """A (e.g. the base model) against B (the trained one) at equal generated tokens per problem: for each budget,
    each side's samples and tokens used, best-of-N (verifier: oracle) and majority accuracy with percentile
    bootstrap intervals over problems, and the paired differences B maj − A maj and B maj − A best-of-N."""
    from posttrain.eval import stats

    def iv(xs):
        mean, lo, hi = stats.bootstrap_interval(xs, confidence, 10000, seed)
        return {"value": mean, "low": lo, "high": hi}

    def diff(x, y):
        r = stats.paired_bootstrap(x, y, confidence, 10000, seed)
        return {"value": r["diff"], "low": r["low"], "high": r["high"]}

    rows = []
    for budget in budgets:
        x, y = at_budget(a, budget, orders, seed), at_budget(b, budget, orders, seed)
        side = lambda rs: {"samples": sum(r["m"] for r in rs) / len(rs), "tokens": sum(r["tokens"] for r in rs) / len(rs),
                           "best_of_n": iv([r["bon"] for r in rs]), "majority": iv([r["maj"] for r in rs])}
        rows.append({"budget": budget, "a": side(x), "b": side(y), "b_maj_minus_a_maj": diff([r["maj"] for r in x], [r["maj"] for r in y]),
                     "b_maj_minus_a_best_of_n": diff([r["bon"] for r in x], [r["maj"] for r in y])})
    return {"rows": rows, "orders": orders, "confidence": confidence,
            "method": f"mean over {orders} orders of each problem's samples; percentile bootstrap over problems (paired for differences); "
                      "best-of-N by the verifier sees the reference (an oracle), majority does not"}
