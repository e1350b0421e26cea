"""ops.tied: a tied embedding's lookup adds its rows into the head's gradient buffer; the gradients are the stock ones."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from conftest import conv
from posttrain.data.packing import IGNORE, collate
from posttrain.data.templates import render_messages
from posttrain.models.forward import hidden_states, logit_head, token_logprobs
from posttrain.models.loading import load_model
from posttrain.ops import tied


class _Count(TorchDispatchMode):
    """Counts aten.embedding_dense_backward calls (the stock lookup gradient: a dense (V, H) buffer)."""

    def __init__(self):
        super().__init__()
        self.dense = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.embedding_dense_backward.default:
            self.dense += 1
        return func(*args, **(kwargs or {}))


def _batch(tok, n=4):
    s = [render_messages(tok, conv(f"What is {i} + {i}?", f"{i} + {i} = {2 * i}" + " ok" * i)["messages"])
         for i in range(1, n + 1)]
    return collate([s], tok.pad_token_id, packed=True)


def _grads(model, batch, use_tie: bool, monkeypatch):
    """Every parameter's gradient of Σ c_i log p(target_i) (token_logprobs, c_i in [0.5, 1.5]), with the tie or the
    stock path; and (stock path) the terms' sizes that bound a reordered sum: |g_t| of each lookup row, and c_i |h_i|
    of the head (|∂L/∂z_iv| = c_i |1[v = y_i] − p_iv| ≤ c_i)."""
    model.zero_grad(set_to_none=True)
    seen = {}
    def on_lookup(module, args, out):  # the stock path's lookup (the tie's does not call the module)
        if out.requires_grad:
            out.register_hook(lambda g: seen.__setitem__("g", g.detach().clone()))

    hooks = [model.get_input_embeddings().register_forward_hook(on_lookup),
             model.model.norm.register_forward_hook(lambda m, a, out: seen.__setitem__("h", out.detach().clone()))]
    with monkeypatch.context() as m:
        if not use_tie:
            m.setattr("posttrain.models.forward.tie_for", lambda *a: None)
        counter = _Count()
        logp, _ = token_logprobs(model, batch)
        c = torch.linspace(0.5, 1.5, logp.numel(), dtype=logp.dtype)
        with counter:
            (logp * c).sum().backward()
    for h in hooks:
        h.remove()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return grads, counter.dense, seen, c


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_tied_gradients_equal_the_stock_ones_without_a_dense_lookup_buffer(tiny_tok, monkeypatch, dtype):
    model = load_model("tiny-random", dtype=dtype)
    emb = model.get_input_embeddings()
    assert emb.weight is model.get_output_embeddings().weight  # tiny-random ties them
    batch = _batch(tiny_tok)
    got, dense_tied, _, _ = _grads(model, batch, True, monkeypatch)
    want, dense_stock, seen, c = _grads(model, batch, False, monkeypatch)
    assert dense_stock == 1 and dense_tied == 0  # the tie's lookup wrote no (V, H) buffer of its own
    assert got.keys() == want.keys()
    # W's gradient: per element one sum of the head's N terms and token v's k_v lookup rows, added in another order.
    # Any two orders of an n-term sum differ by at most 2·γ_n·Σ|terms| (γ_n = n·u/(1 − n·u), u the unit roundoff).
    u = torch.finfo(dtype).eps / 2
    ids = batch.input_ids.reshape(-1)
    sel = (batch.targets != IGNORE).reshape(-1)
    head_abs = (c[:, None] * seen["h"].reshape(-1, seen["h"].shape[-1])[sel].abs()).sum(0)  # (H,) ≥ Σ_i |∂L/∂z_iv|·|h_i|
    rows_abs = torch.zeros_like(want["model.embed_tokens.weight"]).index_add_(0, ids, seen["g"].reshape(len(ids), -1).abs())
    k = torch.bincount(ids, minlength=rows_abs.shape[0]).to(dtype)[:, None]
    n = int(sel.sum()) + k
    gamma = n * u / (1 - n * u)
    name = "model.embed_tokens.weight"
    assert bool(((got[name] - want[name]).abs() <= 2 * gamma * (head_abs + rows_abs)).all())
    # every other parameter: the same ops on the same values; only a kernel's own run-to-run order may differ
    eps = torch.finfo(dtype).eps
    for other in set(want) - {name}:
        tol = 16 * eps * float(want[other].abs().max()) + 1e-30
        assert float((got[other] - want[other]).abs().max()) <= tol, other
    w = emb.weight.grad
    rows = torch.unique(batch.input_ids)
    assert float(w[rows].abs().sum()) > 0  # the looked-up rows carry the lookup's share


def test_the_padding_row_gets_no_lookup_gradient(tiny_tok):
    model = load_model("tiny-random", dtype=torch.float64)
    emb = model.get_input_embeddings()
    emb.padding_idx = 3  # a row the batch looks up: F.embedding gives it no gradient
    ids = torch.tensor([[3, 5, 3, 7, 9]])
    tie = tied.tie_for(emb, emb.weight)
    out = tie.embed(ids)
    head_grad = torch.ones_like(emb.weight)
    tie.heads = 1
    assert tie.take(head_grad)
    (gw,) = torch.autograd.grad(out, [emb.weight], torch.ones_like(out))
    assert gw.data_ptr() == head_grad.data_ptr()  # the head's buffer, returned with the rows added
    assert torch.equal(gw[3], torch.ones_like(gw[3]))  # padding row: the head's share only
    assert torch.equal(gw[5], torch.full_like(gw[5], 2.0))


def test_no_hand_over_when_the_head_runs_twice(tiny_tok):
    """Two head calls in one forward: each returns its own W gradient; the lookup returns the stock one."""
    model = load_model("tiny-random", dtype=torch.float64)
    batch = _batch(tiny_tok)
    head = logit_head(model)
    h = hidden_states(model, batch, tie=head.tie)
    h = h.reshape(-1, h.shape[-1])[:6]
    t = batch.input_ids.reshape(-1)[1:7]
    a, _ = head.logprobs(h, t)
    b, _ = head.logprobs(h, t)
    counter = _Count()
    with counter:
        (a.sum() + 2 * b.sum()).backward()
    assert counter.dense == 1 and head.tie.heads == 2
    got = model.get_input_embeddings().weight.grad.clone()
    model.zero_grad(set_to_none=True)
    ref_head = logit_head(model)
    object.__setattr__(ref_head, "tie", None)
    h = hidden_states(model, batch).reshape(-1, h.shape[-1])[:6]
    a, _ = ref_head.logprobs(h, t)
    (3 * a.sum()).backward()
    want = model.get_input_embeddings().weight.grad
    assert torch.allclose(got, want, rtol=0, atol=1e-12 * float(want.abs().max()))


def test_tie_applies_only_where_it_is_safe():
    model = load_model("tiny-random")
    emb, w = model.get_input_embeddings(), model.get_output_embeddings().weight
    assert isinstance(tied.tie_for(emb, w), tied.TiedGrad)
    with torch.no_grad():
        assert tied.tie_for(emb, w) is None  # no autograd: nothing to share
    untied = load_model("tiny-random-qwen2")
    assert tied.tie_for(untied.get_input_embeddings(), untied.get_output_embeddings().weight) is None
    assert tied.tie_for(emb, w.detach()) is None  # a frozen head (LoRA)
    emb.scale_grad_by_freq = True
    assert tied.tie_for(emb, w) is None
    emb.scale_grad_by_freq = False

    class Scaled(torch.nn.Embedding):  # e.g. Gemma 3's scaled embedding: its forward is not F.embedding alone
        pass

    scaled = Scaled(4, 2)
    assert tied.tie_for(scaled, scaled.weight) is None
    assert tied.tie_for(emb, w.to(torch.bfloat16)) is None  # bf16 weights: rows added one by one would round


def test_preference_forward_ties_the_embedding(tiny_tok, monkeypatch):
    """DPO/KTO's shared-prefix forward (reference_cache.sequence_logps) hands the head's W gradient to the lookup
    (no dense lookup buffer), with the stock gradients (fp64: equal to rounding)."""
    from posttrain.data import prefix_batch
    from posttrain.data.templates import Tokenized
    from posttrain.recipes.reference_cache import sequence_logps

    model = load_model("tiny-random", dtype=torch.float64)
    groups = [([5, 9, 11, 4], [Tokenized([7, 8, 2], [1, 1, 1]), Tokenized([7, 3, 3, 2], [1, 1, 1, 1])]),
              ([6, 9, 12], [Tokenized([10, 2], [1, 1]), Tokenized([13, 14, 2], [0, 1, 1])])]
    batch = prefix_batch.build(groups, tiny_tok.pad_token_id)

    def grads(use_tie: bool):
        model.zero_grad(set_to_none=True)
        with monkeypatch.context() as m:
            if not use_tie:
                m.setattr("posttrain.models.forward.tie_for", lambda *a: None)
            logps = sequence_logps(model, batch)
            counter = _Count()
            with counter:
                (logps * torch.tensor([1.0, -0.5, 0.25, 2.0], dtype=logps.dtype)).sum().backward()
        return model.get_input_embeddings().weight.grad.clone(), counter.dense

    (got, dense_tied), (want, dense_stock) = grads(True), grads(False)
    assert dense_tied == 0 and dense_stock == 1
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12 * float(want.abs().max()))
