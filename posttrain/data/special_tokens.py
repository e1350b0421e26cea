"""Special / template tokens left out of a preference loss (`posttrain dpo mask_special_tokens=true`).

Llama 3 (Grattafiori et al. 2024, §4.1.4 "Direct Preference Optimization"): "we mask out special formatting
tokens including header and termination tokens from both chosen and rejected responses in the loss to
stabilize DPO training" — those tokens are shared by both responses, and pushing their log-probabilities in
opposite directions only makes the model unsure when to end a turn. Here: every token id the tokenizer marks
special (`all_special_ids` and added tokens flagged special: <|eot_id|>, <|start_header_id|>, <|im_end|>, …)
gets loss mask 0 in each continuation; the summed log-probs (and lengths) of chosen and rejected count the
other tokens only.
"""

from __future__ import annotations

import dataclasses

from posttrain.data.templates import Tokenized


def special_token_ids(tok) -> set[int]:
    """Ids the tokenizer marks special: its special tokens and the added tokens flagged special."""
    ids = set(getattr(tok, "all_special_ids", []) or [])
    for i, added in (getattr(tok, "added_tokens_decoder", {}) or {}).items():
        if getattr(added, "special", False):
            ids.add(int(i))
    return ids


def _spans(mask: list[int]) -> list[tuple[int, int]]:
    """[start, end) runs of mask 1."""
    out, start = [], None
    for i, m in enumerate([*mask, 0]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            out.append((start, i))
            start = None
    return out


def mask_continuation(cont: Tokenized, special: set[int]) -> Tokenized:
    """`cont` with loss mask 0 on special ids (the ids themselves stay: the forward still sees them)."""
    mask = [0 if t in special else m for t, m in zip(cont.input_ids, cont.loss_mask)]
    return Tokenized(list(cont.input_ids), mask, _spans(mask))


def mask_special(examples: list, special: set[int]) -> list:
    """Each TokenizedPair with its continuations' special tokens masked. A continuation left with no trained token
    (it was all template) is refused naming its row."""
    out = []
    for ex in examples:
        conts = [mask_continuation(c, special) for c in ex.continuations]
        for which, c in zip(("chosen", "rejected") if len(conts) == 2 else ("completion",), conts):
            if not any(c.loss_mask):
                raise ex.row.error(which, "mask_special_tokens=true leaves no trained token (the response is only "
                                          "special/template tokens); drop the row or set mask_special_tokens=false")
        out.append(dataclasses.replace(ex, continuations=conts))
    return out
