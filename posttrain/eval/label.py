"""`posttrain label`: preference pairs labelled by an LLM judge (RLAIF), ready for `rm` and `dpo`.

    posttrain label data=prompts.jsonl samples_a=a.jsonl [samples_b=b.jsonl] judge.base_url=http://127.0.0.1:8000/v1 output=pairs.jsonl
    posttrain label data=prompts.jsonl policy_a=runs/sft/final [policy_b=smollm2-135m-instruct] judge.base_url=... output=pairs.jsonl
    posttrain label data=human_pairs.jsonl judge.base_url=... output=pairs.jsonl      # relabel; agreement with the file's labels

Sources of the two responses of a pair, per prompt (k < pairs_per_prompt):
  - one policy: its samples 2k and 2k+1;   two policies: sample k of A against sample k of B.
  Samples come from files in the format `posttrain generate` writes (prompt_index, sample_index, text), or
  are drawn here with the built-in engine from `policy_a` / `policy_b` (`sampling.*` keys).
  - `data` already in preference format (prompt, chosen, rejected): each pair is judged again and the
    judge's agreement with the file's labels (e.g. human ones) is reported (Cohen's kappa too).
Two identical responses are skipped (no preference to learn).

The judge sees each pair in both orders (posttrain.judge.client): the same winner twice gives
chosen/rejected; two different answers are a tie, dropped (ties=drop) or written with "tie": true
(ties=keep: chosen/rejected then keep the a/b order and carry no preference; filter them before DPO).
Output rows follow TRL's preference format — prompt, chosen, rejected (strings, or conversations when
the prompt is one) — plus `judge` (prompt version, its hash, model, each order's verdict) and `source`.
A summary (`<output>.summary.json`: counts, judge calls, retries, failures, tokens, latency, errors) is
printed; pairs the judge could not label are listed there and make the exit status 1.
"""

from __future__ import annotations

import random
import sys
import time

from pydantic import Field

from posttrain.config import Config, parse_args
from posttrain.data.formats import completion_text, load, read_rows
from posttrain.data.templates import render_prompt
from posttrain.errors import UserError
from posttrain.judge.client import Judge, JudgeSettings, PairVerdict
from posttrain.outputs import atomic_open, check_output_file, to_json, write_json
from posttrain.rollout.settings import SamplingSettings
from posttrain.rollout.types import Request


class LabelConfig(Config):
    """Label preference pairs with an LLM judge (both orders; disagreement = tie) and write them as prompt/chosen/rejected."""

    data: str = Field("", description="prompts (.jsonl with `prompt`, or a built-in task), or preference rows (prompt, chosen, rejected) to relabel")
    samples_a: str = Field("", description="samples of policy A: .jsonl as `posttrain generate` writes (prompt_index, sample_index, text)")
    samples_b: str = Field("", description="samples of policy B (same format); without B, pairs are formed among A's samples")
    policy_a: str = Field("", description="instead of samples_a: a model to sample from here (HF folder, built-in name or Hub id)")
    policy_b: str = Field("", description="instead of samples_b: a second model to sample from")
    pairs_per_prompt: int = Field(1, ge=1, description="pairs per prompt: one policy uses samples 2k, 2k+1; two policies sample k of each")
    output: str = Field("pairs.jsonl", description="output .jsonl (TRL preference format); the summary goes to <output>.summary.json")
    ties: str = Field("drop", pattern="^(drop|keep)$", description="pairs whose two orders disagree: drop | keep (written with tie: true)")
    judge: JudgeSettings = Field(default_factory=JudgeSettings)
    sampling: SamplingSettings = Field(default_factory=SamplingSettings)
    seed: int = Field(0, description="sampling seed for policy_a / policy_b (prompt i uses seed + i)")
    dtype: str = Field("float32", description="policy dtype when sampling here")
    device: str = Field("auto", pattern=r"^(auto|cpu|cuda(:\d+)?)$", description="where policies sample: auto | cpu | cuda | cuda:N")


# ---------------------------------------------------------------- inputs


def read_samples(path: str, n_prompts: int) -> dict[int, dict[int, str]]:
    """prompt_index -> sample_index -> text, from a `posttrain generate` file (its error lines are skipped)."""
    out: dict[int, dict[int, str]] = {}
    for row in read_rows(path):
        d = row.data
        if "error" in d and "text" not in d:
            continue
        pi, si, text = d.get("prompt_index"), d.get("sample_index", 0), d.get("text")
        if not isinstance(pi, int) or not 0 <= pi < n_prompts:
            raise row.error("prompt_index", f"must be an integer in [0, {n_prompts}) (the line of the prompt in data), got {pi!r}")
        if not isinstance(si, int) or si < 0:
            raise row.error("sample_index", f"must be a non-negative integer, got {si!r}")
        if not isinstance(text, str):
            raise row.error("text", f"must be a string, got {type(text).__name__}")
        if si in out.setdefault(pi, {}):
            raise row.error("sample_index", f"prompt {pi} has sample {si} twice")
        out[pi][si] = text
    return out


def sample_policy(model_name: str, prompts: list, n: int, cfg: LabelConfig) -> dict[int, dict[int, str]]:
    """n samples per prompt from `model_name` with the built-in engine."""
    from posttrain.models.loading import load_model, load_tokenizer  # torch: only when the policy is sampled
    from posttrain.rollout.engine import Engine, EngineConfig

    tok = load_tokenizer(model_name)
    model = load_model(model_name, dtype=cfg.dtype, device=cfg.device).eval()
    engine = Engine(model, tok, EngineConfig(max_num_seqs=min(256, max(n * len(prompts), 1)), kv_cache_mb=512, seed=cfg.seed))
    reqs = [Request(render_prompt(tok, p), cfg.sampling.params(n=n, seed=cfg.seed + i), i) for i, p in enumerate(prompts)]
    outs = engine.generate(reqs)
    bad = [o.error for o in outs if o.error]
    if bad:
        raise UserError(f"policy {model_name}: {len(bad)} prompts could not be sampled, first: {bad[0]}")
    return {i: {s.index: s.text for s in o.samples} for i, o in enumerate(outs)}


def plan_pairs(n_prompts: int, a: dict, b: dict | None, k: int) -> list[tuple[int, str, str, str, str]]:
    """(prompt_index, label_a, text_a, label_b, text_b) for every pair to judge."""
    pairs = []
    for pi in range(n_prompts):
        sa = a.get(pi, {})
        for j in range(k):
            if b is None:
                if 2 * j + 1 in sa and 2 * j in sa:
                    pairs.append((pi, f"A:{2 * j}", sa[2 * j], f"A:{2 * j + 1}", sa[2 * j + 1]))
            elif j in sa and j in b.get(pi, {}):
                pairs.append((pi, f"A:{j}", sa[j], f"B:{j}", b[pi][j]))
    return pairs


# ---------------------------------------------------------------- outputs


def _as_response(prompt, text: str):
    return [{"role": "assistant", "content": text}] if isinstance(prompt, list) else text


def pair_row(prompt, pair: tuple, v: PairVerdict, models: dict | None = None) -> dict:
    """One output row in TRL's preference format (tie rows keep the a/b order); `models` names the policies behind
    the labels A and B (what `posttrain eval rank` ranks)."""
    pi, la, ta, lb, tb = pair
    chosen, rejected = (tb, ta) if v.winner == "b" else (ta, tb)
    row = {"prompt": prompt, "chosen": _as_response(prompt, chosen), "rejected": _as_response(prompt, rejected)}
    if v.winner == "tie":
        row["tie"] = True
    row["judge"] = {"version": v.version, "digest": v.digest, "model": v.model, "orders": v.orders}
    row["source"] = {"prompt_index": pi, "a": la, "b": lb, "chosen": lb if v.winner == "b" else la}
    if models:
        row["source"]["models"] = models
    return row


def _gather(cfg: LabelConfig, rows) -> tuple[list, list, bool]:
    """(prompts, pairs, whether the pairs carry the file's labels) from the config's sources."""
    fmt = "preference" if all(k in rows[0].data for k in ("prompt", "chosen", "rejected")) else "prompt_only"
    prompts = [r.data["prompt"] for r in rows]
    if fmt == "preference":
        if cfg.samples_a or cfg.policy_a:
            raise UserError(f"{cfg.data} holds preference rows already: give no samples_a/policy_a (they are relabelled)")
        rng = random.Random(cfg.seed)  # chosen shown as a or b at random: a constant label would make kappa meaningless
        pairs = []
        for i, r in enumerate(rows):
            c, x = ("chosen", completion_text(r.data["chosen"])), ("rejected", completion_text(r.data["rejected"]))
            first, second = (x, c) if rng.random() < 0.5 else (c, x)
            pairs.append((i, *first, *second))
        return prompts, pairs, True
    if bool(cfg.samples_a) == bool(cfg.policy_a):
        raise UserError("give samples_a=FILE (from posttrain generate) or policy_a=MODEL (sampled here), exactly one")
    if cfg.samples_b and cfg.policy_b:
        raise UserError("give samples_b or policy_b, not both")
    two = two_policies(cfg)
    n_a = cfg.pairs_per_prompt * (1 if two else 2)
    a = read_samples(cfg.samples_a, len(prompts)) if cfg.samples_a else None
    b = read_samples(cfg.samples_b, len(prompts)) if cfg.samples_b else None
    if a is None:
        a = sample_policy(cfg.policy_a, prompts, n_a, cfg)
    if cfg.policy_b:
        b = sample_policy(cfg.policy_b, prompts, cfg.pairs_per_prompt, cfg)
    return prompts, plan_pairs(len(prompts), a, b, cfg.pairs_per_prompt), False


def side_models(cfg: LabelConfig) -> dict:
    """{"A": policy or samples file of side A, "B": …}: who wrote each side's responses."""
    return {k: v for k, v in (("A", cfg.policy_a or cfg.samples_a), ("B", cfg.policy_b or cfg.samples_b)) if v}


def two_policies(cfg: LabelConfig) -> bool:
    return bool(cfg.samples_b or cfg.policy_b)


def win_rates(pairs: list, verdicts: list[PairVerdict]) -> dict | None:
    """A's raw and length-controlled win rate over B (AlpacaEval 2 style, posttrain.eval.winrate) from the
    labelled pairs; failed pairs are left out, identical ones were skipped before judging."""
    from posttrain.eval.winrate import lc_win_rate  # numpy

    done = [(p, v) for p, v in zip(pairs, verdicts) if v.preference is not None]
    if len(done) < 2:
        return None
    return lc_win_rate([v.preference for _, v in done], [len(p[2]) for p, _ in done], [len(p[4]) for p, _ in done])


def label(cfg: LabelConfig) -> dict:
    """Judge the pairs and write them; returns the summary."""
    from posttrain.eval.winrate import agreement  # numpy

    if not cfg.data:
        raise UserError("data: give a prompts .jsonl (or preference rows to relabel)")
    if not cfg.judge.base_url:
        raise UserError("judge.base_url: give the judge's OpenAI-compatible endpoint, e.g. judge.base_url=http://127.0.0.1:8000/v1")
    out = check_output_file(cfg.output)  # before any judge call: a folder or an unwritable path loses nothing
    check_output_file(str(out) + ".summary.json")
    rows, _ = load(cfg.data, allowed=("prompt_only", "prompt_completion", "preference"))
    judge = Judge(cfg.judge)
    judge.connect()  # an unreachable judge is refused before any policy loads
    prompts, pairs, relabel = _gather(cfg, rows)
    same = [p for p in pairs if p[2] == p[4]]
    pairs = [p for p in pairs if p[2] != p[4]]
    t0 = time.perf_counter()
    verdicts = judge.compare_many([(prompts[p[0]], p[2], p[4]) for p in pairs])
    seconds = time.perf_counter() - t0
    written = ties = 0
    with atomic_open(out) as f:
        for pair, v in zip(pairs, verdicts):
            ties += v.winner == "tie"
            if v.winner is None or (v.winner == "tie" and cfg.ties == "drop"):
                continue
            f.write(to_json(pair_row(prompts[pair[0]], pair, v, side_models(cfg)), ensure_ascii=False) + "\n")
            written += 1
    errors = [{"prompt_index": p[0], "a": p[1], "b": p[3], "error": v.error} for p, v in zip(pairs, verdicts) if v.winner is None]
    summary = {"output": str(out), "pairs_judged": len(pairs), "written": written, "decided": sum(v.winner in ("a", "b") for v in verdicts),
               "ties": ties, "ties_written": ties if cfg.ties == "keep" else 0, "identical_skipped": len(same), "failed": len(errors),
               "seconds": seconds, "judge": {"model": judge.model, "version": judge.pairwise.version, **judge.stats.as_dict()},
               "errors": errors}
    if two_policies(cfg) and not relabel:
        summary["win_rate_a_vs_b"] = win_rates(pairs, verdicts)
    if relabel:  # the file's chosen response is the label: 'a' when it was shown as a
        summary["agreement_with_file_labels"] = agreement([v.winner for v in verdicts], ["a" if p[1] == "chosen" else "b" for p in pairs])
    write_json(str(out) + ".summary.json", summary, indent=2)
    judge.close()
    return summary


def main(argv: list[str]) -> int:
    cfg = parse_args(LabelConfig, argv, prog="posttrain label")
    s = label(cfg)
    j = s["judge"]
    print(f"{s['pairs_judged']} pairs judged by {j['model']} ({j['version']}) in {s['seconds']:.1f} s: {s['decided']} decided, "
          f"{s['ties']} ties ({'kept' if cfg.ties == 'keep' else 'dropped'}), {s['failed']} failed, "
          f"{s['identical_skipped']} identical skipped -> {s['written']} rows in {s['output']}")
    print(f"judge: {j['calls']} calls, {j['retries']} retries, {j['malformed']} malformed replies, {j['timeouts']} timeouts, "
          f"{j['prompt_tokens']}+{j['completion_tokens']} tokens, {j['latency_mean_s']:.2f} s mean latency")
    if s.get("win_rate_a_vs_b"):
        w = s["win_rate_a_vs_b"]
        print(f"A vs B: win rate {w['win_rate']:.1f} % (± {w['win_rate_se']:.1f}), length-controlled {w['lc_win_rate']:.1f} % "
              f"over {w['n']} pairs (mean length A {w['mean_length_model']:.0f}, B {w['mean_length_baseline']:.0f} chars)")
    if "agreement_with_file_labels" in s:
        a = s["agreement_with_file_labels"]
        print(f"agreement with the file's labels: {a['agreement']:.3f} over {a['n']} pairs (Cohen's kappa {a['cohen_kappa']:.3f}; "
              f"{a['agreement_decided']:.3f} where the judge decided)")
    for e in s["errors"][:5]:
        print(f"  prompt {e['prompt_index']} ({e['a']} vs {e['b']}): {e['error']}", file=sys.stderr)
    return 1 if s["failed"] else 0
