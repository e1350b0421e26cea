"""`posttrain generate model=… data=prompts.jsonl n=… output=samples.jsonl [sampling keys] backend=builtin|hf|vllm`.

Each input line has `prompt`: a string (rendered with the chat template, add_generation_prompt) or a
`[{role, content}]` list. Each output line is one sample, in the columns `posttrain sft`, `posttrain score`
and TRL's trainers read: the row's columns, `prompt` as it was rendered (a conversation whenever the chat
template was applied, a string prompt becoming one user turn), `completion` in the prompt's form (one
assistant turn after a conversation, else the text), `messages` (prompt + completion, for conversations),
and prompt_index, sample_index, text, token_ids, logprobs (behaviour log-probs), finish_reason; bad prompts
give one line with `error`.

`select=best_of_n|majority reward=… n=N` (rollout/select.py): N samples per prompt, one line per prompt with the
kept sample (`sample_index` is its index among the N) and `selection` {method, n, index, rewards | answers,
classes, votes}; `generated_tokens` counts all N samples (the cost of the selection).
"""

from __future__ import annotations

import time
from pathlib import Path

from pydantic import Field, field_validator

from posttrain.config import MODEL_HELP, Config, backend_field, chat_template_args_field, chat_template_field, parse_args
from posttrain.data import formats
from posttrain.data.templates import check_template, has_template, render_prompt
from posttrain.errors import UserError
from posttrain.outputs import atomic_open, check_output_file, to_json
from posttrain.rollout.select import HELP as SELECT_HELP
from posttrain.rollout.select import check_select
from posttrain.rollout.settings import check_stops
from posttrain.rollout.types import Request, SamplingParams


class GenerateConfig(Config):
    """Sample completions for a file of prompts."""

    _stops = field_validator("stop_strings")(check_stops)

    model: str = Field("tiny-random", description=MODEL_HELP)
    data: str = Field("", description="prompts .jsonl: one object per line with `prompt` (string or [{role, content}] list)")
    output: str = Field("samples.jsonl", description="output .jsonl, one line per sample")
    backend: str = backend_field()
    chat_template: str = chat_template_field()
    chat_template_args: dict = chat_template_args_field()
    n: int = Field(1, ge=1, description="samples per prompt")
    temperature: float = Field(1.0, ge=0, description="sampling temperature; 0 = greedy")
    top_p: float = Field(1.0, gt=0, le=1, description="nucleus sampling mass; 1 = off")
    top_k: int = Field(0, ge=0, description="keep the k most probable tokens; 0 = off")
    max_new_tokens: int = Field(256, ge=1, description="new tokens per sample")
    stop_strings: list[str] = Field(default_factory=list, description="text stops, e.g. ['</answer>']")
    ignore_eos: bool = Field(False, description="do not stop at the end-of-sequence token")
    seed: int = Field(0, description="sampling seed; prompt i uses seed + i")
    dtype: str = Field("float32", description="model dtype: float32 | bfloat16 (GPU, or CPUs with AMX: ~2x faster decode here)")
    device: str = Field("auto", pattern=r"^(auto|cpu|cuda(:\d+)?)$", description="auto (cuda if a GPU is visible, else cpu) | cpu | cuda | cuda:N")
    max_num_seqs: int = Field(64, ge=1, description="builtin: sequences decoded together")
    max_model_len: int = Field(2048, ge=2, description="prompt + completion tokens per sequence")
    kv_cache_mb: float = Field(1024, gt=0, description="builtin: KV cache size in MiB")
    select: str = Field("", description=SELECT_HELP)
    reward: str = Field("", description="select=: the reward that ranks (best_of_n) or the math verifier whose extraction votes (majority): math, rm:PATH, …")
    reward_args: dict = Field(default_factory=dict, description="options per reward, e.g. {math: {mode: last_number}}")


def read_prompts(path: str, tokenizer) -> tuple[list[list[int]], list[dict]]:
    """(token ids of every `prompt`, the rows): with a chat template a string prompt becomes one user turn and
    the template adds the generation header; without one (a base model) it is plain text, and conversations
    are refused naming chat_template=. The rows' other columns (e.g. `answer`) travel to the output for `score`;
    each row's `prompt` is the one rendered (the user turn a string became)."""
    rows, _ = formats.load(path, allowed=("prompt_only", "prompt_completion"))
    check_template(tokenizer, rows)
    prompts, out = [], []
    for row in rows:
        prompt = row.data["prompt"]
        if isinstance(prompt, str) and has_template(tokenizer):
            prompt = [{"role": "user", "content": prompt}]
        prompts.append(render_prompt(tokenizer, prompt))
        out.append({**row.data, "prompt": prompt})
    return prompts, out


def sample_row(row: dict, text: str) -> dict:
    """The training columns of one sample: the row's columns, `completion` in its prompt's form (TRL concatenates
    prompt + completion, so both are conversations or both strings), `messages` for conversations."""
    extra = {k: v for k, v in row.items() if k not in ("messages", "completion")}
    if isinstance(row["prompt"], list):
        completion = [{"role": "assistant", "content": text}]
        return {**extra, "completion": completion, "messages": row["prompt"] + completion}
    return {**extra, "completion": text}


def make_backend(cfg: GenerateConfig, tok):
    """The backend of a generate/eval config (rollout/backends.py picks and builds it); the weights load here,
    after the prompts were checked."""
    from posttrain.models.loading import load_model  # torch: not for --help
    from posttrain.rollout.backends import build_backend
    from posttrain.rollout.engine import EngineConfig

    ecfg = EngineConfig(max_num_seqs=cfg.max_num_seqs, max_model_len=cfg.max_model_len, kv_cache_mb=cfg.kv_cache_mb, seed=cfg.seed)
    model = None if cfg.backend == "vllm" else load_model(cfg.model, dtype=cfg.dtype, device=cfg.device).eval()  # vLLM loads its own
    return build_backend(cfg.backend, model, tok, ecfg, model_name=cfg.model, dtype=cfg.dtype)


def write_samples(path: str, outs, rows: list[dict]) -> int:
    """One line per sample (or per failed prompt); returns the tokens generated."""
    n_tok = 0
    with atomic_open(path) as f:
        for o in outs:
            if o.error:
                f.write(to_json({"prompt_index": o.request_id, "error": o.error}) + "\n")
                continue
            for s in o.samples:
                n_tok += len(s.token_ids)
                f.write(to_json(sample_line(rows[o.request_id], o.request_id, s)) + "\n")
    return n_tok


def sample_line(row: dict, prompt_index: int, s) -> dict:
    """The row's columns (prompt, answer, tests...) + completion (+ messages): what score, sft and TRL read."""
    return {**sample_row(row, s.text), "prompt_index": prompt_index, "sample_index": s.index, "text": s.text,
            "token_ids": s.token_ids, "logprobs": s.logprobs, "finish_reason": s.finish_reason}


def write_selected(path: str, outs, rows: list[dict], selector) -> tuple[int, int]:
    """One line per prompt: the kept sample with its `selection`; returns (tokens generated by all samples, prompts)."""
    ok = [o for o in outs if not o.error]
    groups = [(rows[o.request_id]["prompt"], rows[o.request_id], [s.text for s in o.samples], [s.token_ids for s in o.samples])
              for o in ok]
    choices = dict(zip([o.request_id for o in ok], selector.choose(groups)))
    n_tok = 0
    with atomic_open(path) as f:
        for o in outs:
            if o.error:
                f.write(to_json({"prompt_index": o.request_id, "error": o.error}) + "\n")
                continue
            spent = sum(len(s.token_ids) for s in o.samples)
            n_tok += spent
            ch = choices[o.request_id]
            line = sample_line(rows[o.request_id], o.request_id, o.samples[ch.index])
            f.write(to_json({**line, "selection": ch.record(selector.method), "generated_tokens": spent}) + "\n")
    return n_tok, len(ok)


def main(argv: list[str]) -> None:
    cfg = parse_args(GenerateConfig, argv, prog="posttrain generate")
    if not cfg.data:
        raise UserError("data: give a prompts .jsonl file (data=prompts.jsonl)")
    check_output_file(cfg.output)  # a folder or an unwritable path is refused before anything is generated
    check_select(cfg.select, cfg.n, cfg.reward)
    from posttrain.models.loading import load_tokenizer  # not for --help

    tok = load_tokenizer(cfg.model, cfg.chat_template, cfg.chat_template_args)
    prompts, rows = read_prompts(cfg.data, tok)  # refused before the weights load
    selector = None
    if cfg.select:
        from posttrain.rewards.pool import default_pool
        from posttrain.rollout.select import Selector

        selector = Selector(cfg.select, cfg.reward, cfg.reward_args, default_pool(), cfg.n)  # rm: folder checked here
        selector.check_rows(rows, cfg.data)
    backend = make_backend(cfg, tok)
    requests = [Request(p, SamplingParams(n=cfg.n, temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k,
                                          max_new_tokens=cfg.max_new_tokens, stop_strings=list(cfg.stop_strings),
                                          ignore_eos=cfg.ignore_eos, seed=cfg.seed + i), request_id=i)
                for i, p in enumerate(prompts)]
    t = time.perf_counter()
    outs = backend.generate(requests)
    dt = time.perf_counter() - t
    Path(cfg.output).parent.mkdir(parents=True, exist_ok=True)
    if selector is None:
        n_tok = write_samples(cfg.output, outs, rows)
        what = f"{len(prompts)} prompts x {cfg.n} samples -> {cfg.output}"
    else:
        n_tok, kept = write_selected(cfg.output, outs, rows, selector)
        what = f"{len(prompts)} prompts x {cfg.n} samples, {kept} kept by {selector.describe()} -> {cfg.output}"
    errors = sum(1 for o in outs if o.error)
    print(f"{what}: {n_tok} tokens in {dt:.2f} s = {n_tok / max(dt, 1e-9):.1f} tokens/s"
          + (f"; {errors} prompts failed (see their error lines)" if errors else ""))
    if hasattr(backend, "metrics"):
        m = backend.metrics()
        print("engine: " + ", ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in m.items()))
    if outs and errors == len(outs):  # nothing was sampled: not a success, however well the file was written
        first = next(o.error for o in outs if o.error)
        raise UserError(f"every prompt failed ({errors} of {len(outs)}; first: {first}); their error lines are in {cfg.output}")
