"""`posttrain eval env=...`: n episodes per problem; success rate, pass@k, pass^k with intervals, turns,
tool calls, tool errors and timeouts, environment vs model time; results.json in the format of
`posttrain eval` (so `posttrain eval compare A B` works on it) and report.html with histograms and
a few episodes rendered turn by turn, the model's own tokens highlighted (loss mask 1).

    posttrain eval env=calculator data=multiply_3x2:100 model=runs/sft/final n=4 \\
        agent.max_turns=3 max_new_tokens=48 output_dir=runs/eval/agent

An episode succeeds when the environment's reward is >= threshold.
"""

from __future__ import annotations

import html
import time
from collections import Counter
from pathlib import Path

from pydantic import Field

from posttrain.agentic.episodes import episode_metrics, render_episode, setup_agent
from posttrain.agentic.rollout import new_episodes, run_episodes
from posttrain.agentic.settings import AgentSettings
from posttrain.config import Config, backend_field, parse_args
from posttrain.errors import UserError
from posttrain.eval import metrics as M
from posttrain.eval import protocol as P
from posttrain.eval.config import default_ks, parse_ks
from posttrain.eval.prompts import load_rows
from posttrain.eval.report import metrics_table
from posttrain.eval.results import print_metrics, summarize
from posttrain.eval.runner import make_backend
from posttrain.models.loading import load_tokenizer
from posttrain.outputs import check_output_dir, write_json
from posttrain.rollout import signals
from posttrain.rollout.settings import SamplingSettings

FORMAT = "posttrain.eval/1"


class AgentEvalConfig(Config):
    """posttrain eval env=...: evaluate a model in a multi-turn environment with tools."""

    model: str = Field("tiny-random", description="HF folder, built-in name or Hub id")
    env: str = Field(..., description="environment: calculator, python_code, search_qa or path/to/file.py:Class")
    env_args: dict = Field(default_factory=dict, description="keyword arguments of the environment class")
    data: str = Field("multiply_3x2:100", description="task or .jsonl the environment starts episodes from (`prompt` + its columns)")
    output_dir: str = Field("runs/eval", description="where results.json and report.html go")
    backend: str = backend_field()
    n: int = Field(1, ge=1, description="episodes per problem")
    k: list[int] = Field(default_factory=list, description="k for pass@k and pass^k (default 1, 2, 4, … up to n)")
    threshold: float = Field(1.0, description="an episode succeeds when its reward >= threshold")
    sampling: SamplingSettings = Field(default_factory=SamplingSettings)
    agent: AgentSettings = Field(default_factory=AgentSettings)
    seed: int = Field(0, description="episode seeds derive from it")
    max_items: int = Field(0, ge=0, description="first N problems only (0: all)")
    confidence: float = Field(0.95, gt=0, lt=1, description="interval coverage")
    bootstrap: int = Field(2000, ge=100, description="bootstrap resamples over problems")
    dtype: str = Field("float32", description="float32 | bfloat16")
    device: str = Field("auto", pattern=r"^(auto|cpu|cuda(:\d+)?)$", description="auto | cpu | cuda | cuda:N")
    max_num_seqs: int = Field(64, ge=1, description="builtin: sequences decoded together")
    max_model_len: int = Field(2048, ge=2, description="prompt + response tokens per episode")
    kv_cache_mb: float = Field(1024, gt=0, description="builtin: KV cache size in MiB")
    report_samples: int = Field(4, ge=0, description="episodes rendered in report.html")

    @property
    def ks(self) -> list[int]:
        ks = parse_ks(self.k) or default_ks(self.n)
        if max(ks) > self.n:
            raise UserError(f"k={max(ks)} > n={self.n}: pass@k needs at least k episodes per problem")
        return ks


def item_values(rewards: list[float | None], threshold: float, ks: list[int]) -> dict:
    correct = [r is not None and r >= threshold for r in rewards]
    n, c = len(correct), sum(correct)
    out: dict = {"c": c, "n": n}
    out.update({f"pass@{k}": M.pass_at_k(n, c, k) for k in ks})
    out.update({f"pass^{k}": M.pass_hat_k(n, c, k) for k in ks})
    out["mean@n"] = M.mean_at_n(rewards)
    return out


def run_agent_eval(cfg: AgentEvalConfig) -> dict:
    ks = cfg.ks
    check_output_dir(cfg.output_dir)
    tok = load_tokenizer(cfg.model)
    rows = load_rows(cfg.data, cfg.max_items)
    agent = setup_agent(cfg, tok, rows)  # env, format, a reset per row: checked before the model loads
    out = Path(cfg.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    backend = make_backend(cfg, tok)
    load_s = time.perf_counter() - t0
    groups = new_episodes(agent.make_env, [r.data for r in rows], cfg.n, agent.fmt, cfg.seed)
    engine_window = signals.start(backend)
    stats = run_episodes(backend, agent.fmt, groups, cfg.agent, cfg.sampling, tok)
    engine = engine_window("engine/")  # tokens/s, KV occupancy, preemptions over the episodes
    values = [item_values([e.reward for e in g], cfg.threshold, ks) for g in groups]
    episodes = [e for g in groups for e in g]
    agent_metrics = {k.removeprefix("agent/"): v for k, v in episode_metrics(episodes, stats, cfg.threshold).items()}
    template = getattr(tok, "chat_template", None) or ""
    proto = {"model": {"name": cfg.model, "sha256": P.model_hash(cfg.model)},
             "data": {"source": cfg.data, "hash": P.data_hash([r.data for r in rows]), "items": len(rows), "max_items": cfg.max_items},
             "chat_template": {"applied": True, "sha256": P.sha256_text(template), "text": template},
             "system_prompt": cfg.env_args.get("system_prompt", ""), "few_shot": [],
             "example_prompt": tok.decode(groups[0][0].prompt_ids) if groups else "",
             "sampling": cfg.sampling.model_dump(mode="json"), "n": cfg.n, "ks": ks, "seed": cfg.seed,
             "reward": {"spec": f"env:{cfg.env}", "args": cfg.env_args, "threshold": cfg.threshold},
             "extraction": {"mode": None, "require": None}, "agent": cfg.agent.model_dump(mode="json"),
             "tool_format": agent.fmt.name, "backend": cfg.backend, "dtype": cfg.dtype, "device": cfg.device}
    doc = {"format": FORMAT, "protocol": proto, "metrics": summarize(values, cfg.n, cfg.confidence, cfg.bootstrap, cfg.seed),
           "agent": {**agent_metrics,
                     "turns_histogram": _hist(len(e.turns) for e in episodes),
                     "tool_calls_histogram": _hist(len(e.tool_calls) for e in episodes),
                     "tool_status": dict(Counter(c["status"] for e in episodes for c in e.tool_calls)),
                     "finish_reasons": dict(Counter(e.finish_reason for e in episodes))},
           "counts": {"items": len(rows), "episodes": len(episodes)},
           "timing": {"model_load_s": load_s, "wall_s": stats.wall_s, "model_s": stats.model_s, "env_s": stats.env_s,
                      "requests": stats.requests, "prefill_tokens": stats.prefill_tokens, **engine},
           "confidence": cfg.confidence,
           "items": [_item(i, r, g, v, cfg.threshold) for i, (r, g, v) in enumerate(zip(rows, groups, values))],
           "episodes": [render_episode(e, tok) for e in episodes[: cfg.report_samples]]}
    write_json(out / "results.json", doc, ensure_ascii=False, default=str)
    write_report(out, doc)
    return doc


def _hist(values) -> dict:
    return {str(k): v for k, v in sorted(Counter(values).items())}


def _item(i: int, row, group, values: dict, threshold: float) -> dict:
    prompt = row.data.get("prompt")
    question = prompt if isinstance(prompt, str) else next((m["content"] for m in reversed(prompt or []) if m["role"] == "user"), "")
    rec = {"index": i, "id": str(row.data.get("id", row.number)), "question": question, "answer": row.data.get("answer"),
           **values, "correct": [int(e.reward is not None and e.reward >= threshold) for e in group],
           "scores": [e.reward for e in group], "turns": [len(e.turns) for e in group],
           "tool_calls": [len(e.tool_calls) for e in group], "finish_reasons": [e.finish_reason for e in group]}
    if any(e.metrics for e in group):
        rec["env_metrics"] = [e.metrics for e in group]
    return rec


STYLE = ("body{font-family:sans-serif;max-width:1100px;margin:auto}table{border-collapse:collapse}td,th{border:1px solid #ccc;"
         "padding:2px 6px}pre{white-space:pre-wrap;background:#f7f7f7;padding:6px}.m1{background:#d8f5d0}.m0{color:#666}")


def write_report(out: Path, doc: dict) -> Path:
    a = doc["agent"]
    scalars = "".join(f"<tr><th>{html.escape(k)}</th><td>{v if not isinstance(v, float) else f'{v:.4g}'}</td></tr>"
                      for k, v in a.items() if not isinstance(v, dict))
    hists = "".join(f"<h3>{html.escape(name)}</h3><table>" + "".join(
        f"<tr><th>{html.escape(k)}</th><td>{v}</td><td>{'█' * min(v, 80)}</td></tr>" for k, v in a[name].items()) + "</table>"
        for name in ("turns_histogram", "tool_calls_histogram", "tool_status", "finish_reasons"))
    timing = "".join(f"<tr><th>{k}</th><td>{v}</td></tr>" for k, v in doc["timing"].items())
    eps = []
    for e in doc["episodes"]:
        body = "".join(f"<span class=m{s['loss']}>{html.escape(s['text'])}</span>" for s in e["segments"])
        eps.append(f"<h3>problem group {e['group']} sample {e['sample']}: reward {e['reward']}, {e['turns']} turns, "
                   f"{html.escape(e['finish_reason'])}</h3><pre class=m0>{html.escape(e['prompt'][-500:])}</pre><pre>{body}</pre>")
    title = f"agentic eval — {doc['protocol']['model']['name']} in {doc['protocol']['reward']['spec']}"
    page = (f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title><style>{STYLE}</style></head>"
            f"<body><h1>{html.escape(title)}</h1><h2>Metrics</h2>{metrics_table(doc)}<h2>Episodes</h2><table>{scalars}</table>"
            f"{hists}<h2>Time</h2><table>{timing}</table><h2>Episodes turn by turn</h2>"
            f"<p>green: the model's own tokens (loss mask 1); grey: prompt, template glue and tool outputs (mask 0)</p>"
            f"{''.join(eps)}</body></html>")
    path = out / "report.html"
    path.write_text(page)
    return path


def main(argv: list[str]) -> int:
    cfg = parse_args(AgentEvalConfig, argv, prog="posttrain eval env=...")  # a bad key or value: ConfigError, reported by the CLI
    doc = run_agent_eval(cfg)
    print(f"{doc['counts']['items']} problems x {cfg.n} episodes ({cfg.model}, env {cfg.env}, tools via {doc['protocol']['tool_format']})")
    print_metrics(doc)
    a = doc["agent"]
    print(f"  turns {a['turns']:.2f}, tool calls {a['tool_calls']:.2f} per episode; tool errors {a['tool_errors']}, "
          f"timeouts {a['tool_timeouts']}; env {doc['timing']['env_s']:.2f} s vs model {doc['timing']['model_s']:.2f} s "
          f"(wall {doc['timing']['wall_s']:.2f} s)")
    print(f"results: {cfg.output_dir}/results.json, report: {cfg.output_dir}/report.html")
    return 0
