"""The teacher side of distillation: the same-tokenizer check, the teacher's fingerprint (a cache key),
full logits at the positions that carry loss, a chunked loss/backward over those positions, and the
teacher's side of plan.json (what the planner reads for it, what the run measured of it).

    check_same_tokenizer(student_tok, teacher_tok, "student-folder", "teacher-folder")  # UserError otherwise
    logits = position_logits(model, batch, "none", positions)                           # (M, V) fp32
    total, metrics = chunked_backward(h, head, loss_of_chunk, chunk=512)                # one chunk of logits alive

Logit and on-policy distillation compare the two models' distributions token by token, which is
meaningful only when token id i means the same string for both: the check compares the id -> token
maps and names the first id where they differ. Sequence-level distillation exchanges text and works
across tokenizers.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch

from posttrain.errors import UserError
from posttrain.models.forward import backbone_and_head, hidden_states
from posttrain.models.loading import load_tokenizer, resolve
from posttrain.outputs import write_json
from posttrain.plan.measure import Measured, write_measured
from posttrain.plan.predict import resolve_model

# ---------------------------------------------------------------- tokenizers


def id_to_token(tok) -> list[str | None]:
    """Token string of every id (None for an id the tokenizer does not define)."""
    vocab = tok.get_vocab()  # token -> id, added tokens included
    out: list[str | None] = [None] * (max(vocab.values(), default=-1) + 1)
    for token, i in vocab.items():
        out[i] = token
    return out


def first_token_difference(student_tok, teacher_tok) -> tuple[int, str | None, str | None] | None:
    """(id, student's token, teacher's token) of the first id whose token differs; None when the maps agree."""
    a, b = id_to_token(student_tok), id_to_token(teacher_tok)
    for i in range(max(len(a), len(b))):
        sa = a[i] if i < len(a) else None
        sb = b[i] if i < len(b) else None
        if sa != sb:
            return i, sa, sb
    return None


def check_same_tokenizer(student_tok, teacher_tok, student: str, teacher: str, mode: str) -> None:
    """Refuse logit/on-policy distillation across tokenizers, naming the first differing token."""
    diff = first_token_difference(student_tok, teacher_tok)
    if diff is None:
        return
    i, sa, sb = diff
    show = lambda t: "no token" if t is None else repr(t)
    raise UserError(
        f"teacher '{teacher}' and student '{student}' have different tokenizers: token id {i} is {show(sa)} for the "
        f"student and {show(sb)} for the teacher (vocabularies of {len(student_tok)} and {len(teacher_tok)}). "
        f"mode={mode} compares the two distributions token by token and needs the same tokenizer; "
        "mode=sequence (the teacher generates text, the student does SFT on it) works across tokenizers")


def check_same_vocab_size(student_model, teacher_model, student: str, teacher: str) -> None:
    """The two output layers must cover the same ids (a tokenizer can match while one embedding is padded)."""
    vs = student_model.get_output_embeddings().weight.shape[0]
    vt = teacher_model.get_output_embeddings().weight.shape[0]
    if vs != vt:
        raise UserError(f"teacher '{teacher}' has {vt} output logits and student '{student}' has {vs}: "
                        "logit and on-policy distillation need the same vocabulary size")


def load_checked_tokenizers(cfg):
    """(student tokenizer, teacher tokenizer) of a DistillConfig; logit and on-policy modes refuse different vocabularies."""
    tok, teacher_tok = load_tokenizer(cfg.model, cfg.chat_template, cfg.chat_template_args), load_tokenizer(cfg.teacher)
    if cfg.mode != "sequence":
        check_same_tokenizer(tok, teacher_tok, cfg.model, cfg.teacher, cfg.mode)
    return tok, teacher_tok


# ---------------------------------------------------------------- fingerprint


def teacher_fingerprint(name: str, seed: int) -> str:
    """Hash of what determines the teacher's outputs: a folder's config, weight and adapter files
    (content), a built-in tiny model's name and seed, or a Hub id's name."""
    path = resolve(name)
    h = hashlib.sha256()
    if path is None:  # tiny random: the seed decides the weights
        h.update(f"builtin:{name}:seed={seed}".encode())
    elif isinstance(path, str):  # Hub id: the cached snapshot transformers loads
        h.update(f"hub:{path}".encode())
    else:
        for f in sorted(Path(path).rglob("*")):
            if f.is_file() and f.suffix in (".json", ".safetensors", ".bin", ".pt"):
                h.update(str(f.relative_to(path)).encode())
                with f.open("rb") as fh:
                    for block in iter(lambda: fh.read(1 << 20), b""):
                        h.update(block)
    return h.hexdigest()[:16]


def data_fingerprint(samples) -> str:
    """Hash of the tokenized sequences (ids and loss masks): the cache rows follow them one to one."""
    h = hashlib.sha256()
    for s in samples:
        h.update(json.dumps([s.input_ids, s.loss_mask]).encode())
    return h.hexdigest()[:16]


# ---------------------------------------------------------------- logits at loss positions


def position_hidden(model, batch, mixed_precision: str, positions: torch.Tensor, layout=None) -> torch.Tensor:
    """Last hidden states (M, H) at flat positions of the (B, T) batch (row-major indices)."""
    h = hidden_states(model, batch, mixed_precision, layout=layout)  # (B, T, H)
    return h.reshape(-1, h.shape[-1]).index_select(0, positions)


def head_logits(head, h: torch.Tensor) -> torch.Tensor:
    """The model's logits (M, V) fp32: `head` (models.forward.logit_head) in its own dtype, its soft-cap and
    scale included (bf16 logits would err by ~0.1 nat at |z| ~ 20)."""
    return head.logits(h)


@torch.no_grad()
def position_logits(model, batch, mixed_precision: str, positions: torch.Tensor, layout=None) -> torch.Tensor:
    """Teacher logits (M, V) fp32 at the given flat positions; no graph."""
    _, head = backbone_and_head(model)
    return head_logits(head, position_hidden(model, batch, mixed_precision, positions, layout))


def chunked_backward(h: torch.Tensor, head, loss_of_chunk, chunk: int, whole=None) -> tuple[torch.Tensor, dict]:
    """Backpropagate Σ_chunks loss_of_chunk(logits (c, V), rows slice) [+ whole(hidden (M, H))] through
    lm_head and `h` (M, H) with one chunk of logits alive at a time: the losses are backpropagated into a
    detached leaf copy of `h` (and the head's weight), then `h` is backpropagated once with the gathered
    gradient. Both functions return (scalar loss, metrics: tensors or numbers, summed over chunks).
    Returns (total loss detached, summed metrics)."""
    hd = h.detach().requires_grad_(h.requires_grad)
    total = torch.zeros((), device=h.device)
    metrics: dict = {}
    chunk = head.rows_per_chunk(h.shape[0], chunk)  # (chunk x V) logits at most one tile (ops.logprobs), whatever V
    parts = [(lambda s=s: loss_of_chunk(head_logits(head, hd[s : s + chunk]), slice(s, s + chunk)))
             for s in range(0, h.shape[0], chunk)]
    if whole is not None:
        parts.append(lambda: whole(hd))
    for part in parts:
        loss, m = part()
        if loss.requires_grad:
            loss.backward()
        total += loss.detach()
        for k, v in m.items():
            metrics[k] = metrics.get(k, 0.0) + float(v)
    if h.requires_grad and hd.grad is not None:
        h.backward(hd.grad)
    return total, metrics


# ---------------------------------------------------------------- the planner's teacher, measured


def teacher_spec(teacher: str, student_config):
    """What the planner reads for the teacher: its name or folder, or (a PEFT adapter folder, whose size is its
    base's) the student's config."""
    try:
        resolve_model(teacher, "teacher")
        return teacher
    except UserError:
        return student_config


def write_distill_measured(out: Path, measured: Measured, extra: dict) -> dict:
    """plan.json's `measured` plus the teacher's measured side, and predicted/measured ratios for it."""
    path = write_measured(out, measured)
    plan = json.loads(path.read_text())
    plan["measured"]["teacher"] = extra
    pred = plan["predicted"].get("teacher", {})
    comparison = plan.setdefault("comparison", {})
    if pred.get("cache_bytes") and "cache_bytes" in extra:
        comparison["cache_bytes_over_predicted"] = extra["cache_bytes"] / pred["cache_bytes"]
    if pred.get("tokens_to_score") and "teacher_tokens_scored" in extra:
        comparison["teacher_tokens_over_predicted"] = extra["teacher_tokens_scored"] / pred["tokens_to_score"]
    if pred.get("scored_tokens_per_step") and "scored_tokens" in extra and measured.steps:
        comparison["teacher_tokens_over_predicted"] = extra["scored_tokens"] / (pred["scored_tokens_per_step"] * measured.steps)
    if plan["predicted"].get("data_plan"):
        comparison["tokens_over_data_plan"] = measured.tokens / max(plan["predicted"]["data_plan"]["tokens"], 1)
    write_json(path, plan, indent=2)
    return plan
