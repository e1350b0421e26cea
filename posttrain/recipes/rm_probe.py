"""`posttrain rm probe`: check a reward model before RL optimises against it (docs/preference.md).

    length bias    Spearman ρ of reward vs completion length (tokens) over held-out chosen and rejected
                   completions; a warning above `length_warn` (0.3): the RM may pay for length
    best-of-N      N = 1, 2, 4, …, `bon_n` samples of `policy` per prompt: expected reward and length of
                   the RM's pick (exact order statistics over the bon_n samples) against the BoN KL bound
                   log N − (N−1)/N; with `gold` (a verifier) also the pick's gold reward: a gold curve that
                   falls while the RM's rises is over-optimisation (Gao et al. 2023)
    adversarial    edits that add no information (append flattery, reformat as a list, add hedging,
                   repeat a sentence) applied to held-out chosen completions: the reward delta per edit
    calibration    predicted P(chosen ≻ rejected) = σ(r_w − r_l) against the empirical win rate, by bucket

Writes output_dir/probe.json, the plots and report.html.

    posttrain rm probe rm=runs/rm/final data=held_out.jsonl policy=smollm2-135m-instruct bon_n=64
"""

from __future__ import annotations

import json
from pathlib import Path

from pydantic import Field

from posttrain.config import Config, backend_field, chat_template_args_field, chat_template_field, parse_args
from posttrain.data import formats
from posttrain.data.formats import completion_text
from posttrain.data.preference import Pair, load_pairs
from posttrain.data.templates import render_prompt
from posttrain.outputs import check_output_dir, write_json
from posttrain.rewards import probe_stats as st
from posttrain.rollout.settings import SamplingSettings
from posttrain.rollout.types import Request


class ProbeConfig(Config):
    """posttrain rm probe: length bias, best-of-N sweep, adversarial edits and calibration of a reward model."""

    rm: str = Field("runs/rm/final", description="reward model folder (the final/ of `posttrain rm`)")
    data: str = Field("", description="held-out preference pairs (length bias, adversarial edits, calibration)")
    max_pairs: int = Field(256, ge=1, description="pairs used from data")
    policy: str = Field("", description="model sampling the best-of-N sweep (empty: no sweep)")
    prompts: str = Field("", description="prompts of the sweep (prompt-only data); empty: the prompts of data")
    bon_prompts: int = Field(8, ge=1, description="prompts in the sweep")
    bon_n: int = Field(64, ge=1, description="samples per prompt; N = 1, 2, 4, … up to this")
    gold: str = Field("", description="optional verifier reward scoring the sweep's picks, e.g. math")
    gold_args: dict = Field(default_factory=dict, description="options per gold reward, e.g. {math: {mode: last_number}}")
    sampling: SamplingSettings = Field(default_factory=lambda: SamplingSettings(max_new_tokens=128))
    calibration_bins: int = Field(10, ge=2, description="buckets of predicted win probability")
    length_warn: float = Field(0.3, ge=0, le=1, description="warn when Spearman(reward, length) is above this")
    output_dir: str = Field("runs/rm_probe", description="where probe.json, the plots and report.html go")
    device: str = Field("auto", pattern=r"^(auto|cpu|cuda(:\d+)?)$", description="auto | cpu | cuda | cuda:N")
    batch_tokens: int = Field(8192, ge=64, description="tokens per reward-model forward")
    seed: int = Field(0, description="sampling seed of the sweep")
    backend: str = backend_field()
    chat_template: str = chat_template_field()
    chat_template_args: dict = chat_template_args_field()


def score_pairs(scorer, pairs: list[Pair]) -> tuple[list[float], list[float]]:
    prompts = [p.prompt for p in pairs for _ in range(2)]
    completions = [c for p in pairs for c in (p.chosen, p.rejected)]
    r = scorer(prompts, completions)
    return r[0::2], r[1::2]


def length_bias(scorer, pairs: list[Pair], chosen: list[float], rejected: list[float], cfg: ProbeConfig) -> dict:
    """Spearman ρ(reward, completion tokens) over all held-out completions."""
    tok = scorer.tok
    lengths = [len(tok(completion_text(c), add_special_tokens=False)["input_ids"]) for p in pairs for c in (p.chosen, p.rejected)]
    rewards = [r for pair in zip(chosen, rejected) for r in pair]
    rho = st.spearman(rewards, lengths)
    return {"spearman_reward_length": rho, "warn_above": cfg.length_warn, "warning": bool(rho > cfg.length_warn),
            "lengths": lengths, "rewards": rewards}


def _edit(completion, fn):
    """Apply a text edit to a completion (a string, or the last assistant message of a conversation)."""
    if isinstance(completion, str):
        return fn(completion)
    out = [dict(m) for m in completion]
    last = max(i for i, m in enumerate(out) if m["role"] == "assistant")
    out[last]["content"] = fn(out[last]["content"])
    return out


def adversarial(scorer, pairs: list[Pair], base: list[float]) -> dict:
    """Reward delta of each information-free edit of the chosen completions (robust: ≤ 0 on average)."""
    out = {}
    for name, fn in st.ADVERSARIAL.items():
        edited = scorer([p.prompt for p in pairs], [_edit(p.chosen, fn) for p in pairs])
        deltas = [e - b for e, b in zip(edited, base)]
        out[name] = {"mean_delta": sum(deltas) / len(deltas), "frac_increased": sum(d > 0 for d in deltas) / len(deltas),
                     "max_delta": max(deltas)}
    return out


def bon_sweep(scorer, cfg: ProbeConfig, pairs: list[Pair]) -> dict:
    """Best-of-N over `bon_n` samples per prompt: expected RM reward, length (and gold) of the pick."""
    from posttrain.models.device import resolve_device  # torch, math-verify: this module stays light
    from posttrain.models.loading import load_model, load_tokenizer
    from posttrain.rewards.registry import compose
    from posttrain.rollout.backends import build_backend
    from posttrain.rollout.engine import EngineConfig

    if cfg.prompts:
        rows = [r.data for r in formats.load(cfg.prompts, allowed=("prompt_only", "prompt_completion"))[0]]
    else:
        rows = [{"prompt": p.prompt} for p in pairs]
    seen, unique = set(), []
    for r in rows:  # distinct prompts, in order
        if json.dumps(r["prompt"], sort_keys=True) not in seen:
            seen.add(json.dumps(r["prompt"], sort_keys=True))
            unique.append(r)
    rows = unique[: cfg.bon_prompts]
    tok = load_tokenizer(cfg.policy, cfg.chat_template, cfg.chat_template_args)
    model = load_model(cfg.policy, seed=cfg.seed, device=resolve_device(cfg.device)).eval()
    engine = build_backend(cfg.backend, model, tok, EngineConfig(max_num_seqs=min(256, cfg.bon_n * len(rows)), kv_cache_mb=512,
                                                                  seed=cfg.seed), model_name=cfg.policy)
    outs = engine.generate([Request(render_prompt(tok, r["prompt"]), cfg.sampling.params(n=cfg.bon_n, seed=cfg.seed * 1009 + i))
                            for i, r in enumerate(rows)])
    gold = compose(cfg.gold, options=cfg.gold_args) if cfg.gold else None
    ns = [2 ** k for k in range(cfg.bon_n.bit_length()) if 2 ** k <= cfg.bon_n]
    curves = {n: [0.0, 0.0, 0.0] for n in ns}
    for r, out in zip(rows, outs):
        texts = [c.text if c.text is not None else tok.decode(c.token_ids, skip_special_tokens=True) for c in out.samples]
        rewards = scorer([r["prompt"]] * len(texts), texts)
        lengths = [float(len(c.token_ids)) for c in out.samples]
        extra = {k: [v] * len(texts) for k, v in r.items() if k != "prompt"}
        golds = gold([r["prompt"]] * len(texts), texts, **extra) if gold else [0.0] * len(texts)
        golds = [g if g is not None else 0.0 for g in golds]
        for n in ns:
            for k, v in enumerate(st.best_of_n(rewards, n, lengths, golds)):
                curves[n][k] += v / len(rows)
    return {"n": ns, "kl_bound": [st.bon_kl_bound(n) for n in ns], "reward": [curves[n][0] for n in ns],
            "length": [curves[n][1] for n in ns], **({"gold": [curves[n][2] for n in ns]} if gold else {}),
            "prompts": len(rows), "samples_per_prompt": cfg.bon_n}


def plots(out: Path, res: dict) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    files = []

    def save(fig, name):
        fig.tight_layout()
        fig.savefig(out / name)
        plt.close(fig)
        files.append(name)

    lb = res["length_bias"]
    fig, ax = plt.subplots(figsize=(4.2, 3), dpi=100)
    ax.scatter(lb["lengths"], lb["rewards"], s=6, alpha=0.6)
    ax.set(title=f"reward vs length (ρ = {lb['spearman_reward_length']:.2f})", xlabel="completion tokens", ylabel="reward")
    save(fig, "probe_length.png")
    cal = res["calibration"]["bins"]
    fig, ax = plt.subplots(figsize=(4.2, 3), dpi=100)
    ax.plot([0, 1], [0, 1], "k--", linewidth=0.8)
    ax.plot([b["predicted"] for b in cal], [b["empirical"] for b in cal], marker="o")
    ax.set(title=f"calibration (ECE {res['calibration']['ece']:.3f})", xlabel="predicted P(chosen wins)", ylabel="empirical")
    save(fig, "probe_calibration.png")
    adv = res["adversarial"]
    fig, ax = plt.subplots(figsize=(4.2, 3), dpi=100)
    ax.bar(list(adv), [v["mean_delta"] for v in adv.values()])
    ax.axhline(0, color="k", linewidth=0.8)
    ax.set(title="reward change from information-free edits", ylabel="mean Δ reward")
    save(fig, "probe_adversarial.png")
    if "bon" in res:
        bon = res["bon"]
        fig, ax = plt.subplots(1, 2, figsize=(8, 3), dpi=100)
        ax[0].plot(bon["kl_bound"], bon["reward"], marker="o", label="RM reward")
        if "gold" in bon:
            ax2 = ax[0].twinx()
            ax2.plot(bon["kl_bound"], bon["gold"], marker="s", color="C2", label="gold")
            ax2.set_ylabel("gold reward")
        ax[0].set(title="best-of-N: reward", xlabel="KL bound log N − (N−1)/N (nats)", ylabel="RM reward")
        ax[1].plot(bon["kl_bound"], bon["length"], marker="o", color="C1")
        ax[1].set(title="best-of-N: length of the pick", xlabel="KL bound (nats)", ylabel="tokens")
        save(fig, "probe_bon.png")
    return files


def probe(cfg: ProbeConfig) -> dict:
    from posttrain.monitor.report import write_report  # torch, matplotlib
    from posttrain.rewards.reward_model import RewardModelScorer

    check_output_dir(cfg.output_dir)
    pairs = load_pairs(cfg.data)[: cfg.max_pairs]  # refused before any model loads
    scorer = RewardModelScorer(cfg.rm, device=cfg.device, batch_tokens=cfg.batch_tokens)
    scorer.load()
    chosen, rejected = score_pairs(scorer, pairs)
    res = {"rm": cfg.rm, "pairs": len(pairs), "length_bias": length_bias(scorer, pairs, chosen, rejected, cfg),
           "adversarial": adversarial(scorer, pairs, chosen),
           "calibration": st.calibration(chosen, rejected, cfg.calibration_bins)}
    if cfg.policy:
        res["bon"] = bon_sweep(scorer, cfg, pairs)
    res["warnings"] = warnings(res)
    out = Path(cfg.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    images = plots(out, res)
    write_json(out / "probe.json", res)
    table = {"pairwise accuracy": res["calibration"]["accuracy"], "ECE": res["calibration"]["ece"],
             "Spearman(reward, length)": res["length_bias"]["spearman_reward_length"],
             **{f"adversarial {k}: mean Δ": v["mean_delta"] for k, v in res["adversarial"].items()},
             "warnings": res["warnings"]}
    sections = {"summary": table, "calibration": {b["bin"]: b for b in res["calibration"]["bins"]}}
    if "bon" in res:
        sections["best-of-N"] = {f"N={n}": {k: res["bon"][k][i] for k in ("kl_bound", "reward", "length", "gold") if k in res["bon"]}
                                 for i, n in enumerate(res["bon"]["n"])}
    write_report(out, f"Reward model probe — {cfg.rm}", sections, images=images)
    return res


def warnings(res: dict) -> list[str]:
    out = []
    lb = res["length_bias"]
    if lb["warning"]:
        out.append(f"reward correlates with length: Spearman ρ = {lb['spearman_reward_length']:.2f} > {lb['warn_above']}")
    for name, v in res["adversarial"].items():
        if v["mean_delta"] > 0 and v["frac_increased"] > 0.5:
            out.append(f"the '{name}' edit raises the reward ({v['frac_increased']:.0%} of completions, mean Δ {v['mean_delta']:+.3f})")
    return out


def main(argv: list[str]) -> None:
    cfg = parse_args(ProbeConfig, argv, prog="posttrain rm probe")
    res = probe(cfg)
    print(f"pairwise accuracy {res['calibration']['accuracy']:.3f}; ECE {res['calibration']['ece']:.3f}; "
          f"Spearman(reward, length) {res['length_bias']['spearman_reward_length']:.3f}")
    for w in res["warnings"]:
        print(f"WARNING: {w}")
    print(f"report: {cfg.output_dir}/report.html")
