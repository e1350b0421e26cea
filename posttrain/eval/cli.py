"""`posttrain eval`: evaluate a model on a task with verifiers; `eval compare`; `eval contamination`.

    posttrain eval model=runs/rl/final data=single_digit_add:all n=8 k=1,2,4,8 reward=math \\
        reward_args="{math: {mode: last_number}}" max_new_tokens=24 output_dir=runs/eval/rl
    posttrain eval compare runs/eval/base/results.json runs/eval/rl/results.json [allow_protocol_diff=true]
    posttrain eval contamination train=data/train.jsonl eval=single_digit_add:all [n=13]
    posttrain eval rank pairs_ab.jsonl pairs_bc.jsonl [anchor=NAME] [bootstrap=1000]

Everything that can be wrong with the data, the reward or the options is refused before the model
loads. The run writes output_dir/results.json (protocol, metrics with intervals, per-item outcomes
and samples) and output_dir/report.html.
"""

from __future__ import annotations

import time
from pathlib import Path

from posttrain.config import parse_args
from posttrain.errors import UserError
from posttrain.eval import protocol as P
from posttrain.eval.agentic import main as agent_main
from posttrain.eval.compare import main as compare_main
from posttrain.eval.config import EvalConfig
from posttrain.eval.contamination import main as contamination_main
from posttrain.eval.prompts import build_items, check_columns, few_shot_messages, load_rows
from posttrain.eval.report import write_eval_report
from posttrain.eval.results import curve, item_record, item_values, print_metrics, summarize, unscored
from posttrain.eval.runner import extraction_settings, generate_and_score, make_backend, template_file
from posttrain.eval.selection import EvalSelection, print_selection
from posttrain.models.loading import load_tokenizer
from posttrain.outputs import check_output_dir, write_json
from posttrain.rewards.pool import default_pool

FORMAT = "posttrain.eval/1"


def default_reward(rows) -> str:
    """code when the rows carry tests or stdio cases, else math."""
    return "code" if any(k in rows[0].data for k in ("tests", "stdio")) else "math"


def prepare(cfg: EvalConfig):
    """Data, reward, prompts: checked and rendered before any model loads. -> (items, reward_fn, spec, ex, shots, tok)"""
    from posttrain.rewards.registry import compose  # math-verify (slow): not for eval compare / contamination

    rows = load_rows(cfg.data, cfg.max_items)
    spec = cfg.reward or default_reward(rows)
    reward_fn = compose(spec, on_error="record", options={k: dict(v) for k, v in cfg.reward_args.items()})
    check_columns(rows, reward_fn.columns)
    ex = extraction_settings(reward_fn.parts, cfg.reward_args)
    shots = few_shot_messages(cfg.few_shot)
    tok = load_tokenizer(cfg.model, template_file(cfg.chat_template), cfg.chat_template_args)
    items = build_items(tok, rows, cfg.system_prompt, shots, cfg.chat_template != "none")
    return items, reward_fn, spec, ex, shots, tok


def make_protocol(cfg: EvalConfig, items, spec: str, ex: dict | None, shots: list, tok) -> dict:
    template = getattr(tok, "chat_template", None) or ""
    return {
        "model": {"name": cfg.model, "sha256": P.model_hash(cfg.model)},
        "data": {"source": cfg.data, "hash": P.data_hash([it.data for it in items]), "items": len(items), "max_items": cfg.max_items},
        "chat_template": {"applied": items[0].messages is not None, "sha256": P.sha256_text(template), "text": template},
        "system_prompt": cfg.system_prompt, "few_shot": shots, "example_prompt": items[0].prompt_text,
        "sampling": cfg.sampling.model_dump(mode="json"), "n": cfg.n, "ks": cfg.ks, "seed": cfg.seed,
        "reward": {"spec": spec, "args": cfg.reward_args, "threshold": cfg.threshold},
        "extraction": ex or {"mode": None, "require": None},
        "backend": cfg.backend, "dtype": cfg.dtype, "device": cfg.device,
    }


def run_eval(cfg: EvalConfig) -> dict:
    """Evaluate; write results.json and report.html; return the results."""
    check_output_dir(cfg.output_dir)  # a file, or a path under one, is refused before the model loads
    items, reward_fn, spec, ex, shots, tok = prepare(cfg)
    pool = default_pool(cfg.workers)
    selection = EvalSelection(cfg, items, reward_fn, ex, pool) if cfg.select else None  # refused before the model loads
    out = Path(cfg.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    proto = make_protocol(cfg, items, spec, ex, shots, tok)
    t_load = time.perf_counter()
    backend = make_backend(cfg, tok)
    proto["backend"] = getattr(backend, "name", cfg.backend)  # what `auto` picked
    load_s = time.perf_counter() - t_load
    results, timing = generate_and_score(backend, items, reward_fn, cfg.sampling, cfg.n, cfg.seed, cfg.threshold, ex, pool)
    values = [item_values(r, cfg.n, cfg.ks, ex is not None, cfg.max_subsets, cfg.seed) for r in results]
    records = selection.apply(results, values) if selection else None  # bon@k | maj@k per problem
    summary = summarize(values, cfg.n, cfg.confidence, cfg.bootstrap, cfg.seed)
    counts = {"items": len(items), "samples": len(items) * cfg.n, "refused": sum(1 for r in results if r.error),
              "reward_errors": timing.pop("reward_errors"), "cluster_fallbacks": timing.pop("cluster_fallbacks"),
              "truncated": sum(s.finish_reason == "length" for r in results for s in r.samples)}
    doc = {"format": FORMAT, "protocol": proto, "metrics": summary, "curve": curve(summary, cfg.ks), "counts": counts,
           "timing": {"model_load_s": load_s, **timing}, "confidence": cfg.confidence,
           "items": [item_record(r, v, cfg.save_samples) for r, v in zip(results, values)]}
    if selection:
        doc["selection"] = selection.report(summary)
        for rec, extra in zip(doc["items"], records):
            rec["selection"] = extra
    if (why := unscored(results)) is not None:  # a pass@1 of 0.000 with an interval would be a fake result
        doc["metrics"], doc["curve"], doc["unscored"] = {}, [], why
    write_json(out / "results.json", doc, ensure_ascii=False)
    write_eval_report(out, doc, cfg.report_samples)
    if why is not None:
        raise UserError(f"no sample was scored: {why}; the samples are in {out / 'results.json'}, no metric was computed")
    return doc


def print_summary(doc: dict, out_dir: str) -> None:
    c = doc["counts"]
    print(f"{c['items']} problems x {doc['protocol']['n']} samples ({doc['protocol']['model']['name']}, {doc['protocol']['data']['source']})")
    print_metrics(doc)
    t = doc["timing"]
    print(f"  {t['generated_tokens']} tokens in {t['wall_s']:.2f} s = {t['tokens_per_s']:.1f} tokens/s "
          f"(generation {t['generate_s']:.2f} s, scoring after it {t['scoring_after_generation_s']:.2f} s)")
    if "selection" in doc:
        print_selection(doc["selection"], round(100 * doc["confidence"]))
    for key in ("refused", "reward_errors", "cluster_fallbacks"):
        if c[key]:
            print(f"  warning: {c[key]} {key.replace('_', ' ')} (see results.json)")
    print(f"results: {out_dir}/results.json, report: {out_dir}/report.html")


def main(argv: list[str]) -> int | None:
    if argv and argv[0] == "compare":
        return compare_main(argv[1:])
    if any(a.startswith(("env=", "--env=")) or a == "--env" for a in argv):  # multi-turn episodes with tools (eval/agentic.py)
        return agent_main(argv)
    if argv and argv[0] == "contamination":
        return contamination_main(argv[1:])
    if argv and argv[0] == "rank":  # Bradley–Terry over pairwise results (eval/rank.py)
        from posttrain.eval.rank import main as rank_main

        return rank_main(argv[1:])
    cfg = parse_args(EvalConfig, argv, prog="posttrain eval [compare A B | contamination | rank FILE...]")  # a bad key or value: ConfigError, reported by the CLI
    doc = run_eval(cfg)
    print_summary(doc, cfg.output_dir)
    return 0
