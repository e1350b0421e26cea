"""The model's log-probs of given tokens, as an OpenAI-compatible server reports them (`logprobs`, `echo`).

Two definitions, both at temperature 1 and before any top-k / top-p cut (the model's own distribution,
what OpenAI and vLLM report by default):

- `logits_logprobs(logits, tokens, k)`: rows of logits already computed (the engine's, at each sampled
  token) -> each token's log_softmax and the k most likely tokens of its row.
- `prompt_logprobs(model, ids, k)`: log p(ids[t] | ids[:t]) for every t >= 1 from one forward of the
  sequence but its last token through the model's own layers (the computation lm-evaluation-harness's
  `hf` model does for a log-likelihood: `log_softmax(model(ids[:-1]).logits)`; on the CPU bit for bit
  the same numbers), the head applied in chunks of rows of at most `LOGITS_BYTES` of float32 logits (one
  chunk for every prompt of up to 5,461 tokens at a 49k vocabulary), so a long prompt never holds all its
  (T x V) logits at once. The first token has nothing before it: None.
"""

from __future__ import annotations

import torch

from posttrain.rollout.types import TokenLogprob

LOGITS_BYTES = 2**30  # float32 logits one chunk of prompt_logprobs may hold


def logits_logprobs(logits: torch.Tensor, tokens: torch.Tensor, k: int) -> list[TokenLogprob]:
    """Per row of `logits` (N, V): log_softmax(row)[tokens[i]] and the row's top-`k` (id, log-prob), best first.
    The token's value and the top values are read from the same float32 tensor, so a token that is the
    argmax has exactly the top-1 value (lm-eval's greedy check compares them with ==)."""
    lsm = torch.log_softmax(logits.float(), -1)
    chosen = lsm.gather(1, tokens.view(-1, 1).to(lsm.device)).squeeze(1).tolist()
    if k <= 0:
        return [TokenLogprob(c) for c in chosen]
    vals, ids = lsm.topk(min(k, lsm.shape[-1]), -1)
    return [TokenLogprob(c, list(zip(i, v))) for c, i, v in zip(chosen, ids.tolist(), vals.tolist())]


@torch.inference_mode()
def prompt_logprobs(model, ids: list[int], k: int = 0, chunk: int | None = None) -> list[TokenLogprob | None]:
    """[None, lp(ids[1] | ids[:1]), ..., lp(ids[-1] | ids[:-1])] under `model` (eval mode for the call;
    a PEFT model with its adapter), each with its top-`k` alternatives."""
    from posttrain.models.forward import _last_hidden, backbone_and_head

    was_training = model.training
    model.eval()
    try:
        backbone, head = backbone_and_head(model)
        device = head.weight.device
        out: list[TokenLogprob | None] = [None]
        if len(ids) < 2:
            return out
        x = torch.tensor([list(ids)], device=device)
        h = _last_hidden(backbone(input_ids=x[:, :-1], use_cache=False))[0]  # the last token predicts nothing here
        targets = x[0, 1:]
        chunk = chunk or max(1, LOGITS_BYTES // (4 * head.weight.shape[0]))
        for s in range(0, h.shape[0], chunk):
            out += logits_logprobs(head.logits(h[s:s + chunk]), targets[s:s + chunk], k)
        return out
    finally:
        model.train(was_training)
