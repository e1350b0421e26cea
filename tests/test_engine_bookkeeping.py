"""The engine's per-step bookkeeping on CPU (`cpu_kernels.row_uniforms`, `record_tokens`, `slot_layout`: one C++ call
each) against its tensor-op twins (`counter_uniforms` on gathered rows, `Engine._record`, `Runner._slot_offsets` +
`_members`), and the plain-row shortcut of `sample_logits` (`all_plain`): the same values, on random states and
through whole generate calls."""
import types

import pytest
import torch

from posttrain.models.loading import load_model, load_tokenizer
from posttrain.ops import cpu_kernels as K
from posttrain.ops import sampling as S
from posttrain.rollout.engine import Engine, EngineConfig
from posttrain.rollout.runner import Runner
from posttrain.rollout.types import Request, SamplingParams

needs_kernels = pytest.mark.skipif(K.load() is None, reason="CPU kernels not built here")


def _state(slots: int, L: int, g: torch.Generator) -> types.SimpleNamespace:
    """Random per-slot engine state: completions so far, caps, stop ids (-1 pads), stop-string flags."""
    ngen = torch.randint(0, L - 1, (slots,), generator=g)
    return types.SimpleNamespace(
        ngen=ngen, ntok=ngen + torch.randint(1, 50, (slots,), generator=g), last=torch.randint(0, 100, (slots,), generator=g),
        out_tok=torch.randint(0, 100, (slots, L), generator=g), out_lp=torch.randn(slots, L, generator=g),
        out_kept=torch.randint(0, 5, (slots, L), generator=g, dtype=torch.int32),
        stop_ids=torch.where(torch.rand(slots, 3, generator=g) < 0.5, torch.randint(0, 20, (slots, 3), generator=g), -1),
        max_new=ngen + torch.randint(1, 4, (slots,), generator=g), has_stop_str=torch.rand(slots, generator=g) < 0.2,
        seed=torch.randint(-2**62, 2**62, (slots,), generator=g), sidx=torch.randint(0, 64, (slots,), generator=g))


def _clone(st):
    return types.SimpleNamespace(**{k: v.clone() for k, v in vars(st).items()})


@needs_kernels
@pytest.mark.parametrize("seed", range(5))
def test_record_tokens_equals_the_tensor_ops(seed):
    g = torch.Generator().manual_seed(seed)
    slots, L = 40, 12
    st = _state(slots, L, g)
    rows = torch.randperm(slots, generator=g)[:25]  # any order, a subset of the slots
    tok, lp = torch.randint(0, 20, (25,), generator=g), torch.randn(25, generator=g)
    kept = torch.randint(0, 9, (25,), generator=g)
    ref, got = _clone(st), _clone(st)
    want = Engine._record(ref, rows, ref.ngen[rows], tok, lp, kept)
    hits = K.record_tokens(rows, tok, lp, kept, got.ngen, got.ntok, got.last, got.out_tok, got.out_lp, got.out_kept,
                           got.stop_ids, got.max_new, got.has_stop_str)
    assert hits == want and 0 < len(hits) < 25  # the random state makes some rows stop, not all
    for name, v in vars(ref).items():
        assert torch.equal(getattr(got, name), v), name


@needs_kernels
def test_row_uniforms_equal_counter_uniforms_at_the_rows():
    g = torch.Generator().manual_seed(0)
    st = _state(64, 8, g)
    rows = torch.randperm(64, generator=g)[:50]
    want = S._counter_uniforms_eager(st.seed[rows], st.sidx[rows], st.ngen[rows])
    assert torch.equal(K.row_uniforms(st.seed, st.sidx, st.ngen, rows), want)
    with pytest.raises(RuntimeError, match="outside 64 slots"):
        K.row_uniforms(st.seed, st.sidx, st.ngen, torch.tensor([64]))


@needs_kernels
@pytest.mark.parametrize("width", [1, 4, 8])
def test_slot_layout_equals_the_tensor_ops(width):
    g = torch.Generator().manual_seed(width)
    slots = 64
    rows = torch.randperm(slots, generator=g)[:40]  # running slots in any order, some group slots idle
    prompt_len = torch.randint(3, 30, (slots // width,), generator=g)
    positions = prompt_len[rows // width] + torch.randint(0, 20, (40,), generator=g)
    tables = torch.randint(0, 1000, (slots, 8), generator=g)  # block ids; positions reach block 48 // 7 = 6 of 8
    reach = []
    twin = types.SimpleNamespace(width=width, prompt_len=prompt_len, device=torch.device("cpu"), _ensure_slot_kv=reach.append,
                                 block_size=7)
    off, ngs = Runner._slot_offsets(twin, positions, rows)
    members = Runner._members(twin, rows, ngs)
    dst = Runner._paged_rows(twin, positions, rows, tables)
    got_off, got_members, top, got_dst = K.slot_layout(rows, positions, prompt_len, width, tables, 7)
    assert torch.equal(got_off, off) and torch.equal(got_members, members) and [top] == reach
    assert torch.equal(got_dst, dst)
    assert K.slot_layout(rows, positions, prompt_len, width)[3] is None  # no tables: no paged rows
    with pytest.raises(RuntimeError, match="outside the slots"):
        K.slot_layout(torch.tensor([slots]), positions[:1], prompt_len, width)
    with pytest.raises(RuntimeError, match="outside the block tables"):
        K.slot_layout(rows, positions, prompt_len, width, tables[:, :2].contiguous(), 7)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_all_plain_draws_as_the_per_row_checks(dtype):
    g = torch.Generator().manual_seed(1)
    logits = (torch.randn(16, 300, generator=g) * 3).to(dtype)
    t = torch.rand(16, generator=g) + 0.5
    u = torch.rand(16, generator=g, dtype=torch.float64)
    top_k, top_p = torch.zeros(16, dtype=torch.long), torch.ones(16)
    want = S.sample_logits(logits, t, top_k, top_p, u, with_kept=True)
    got = S.sample_logits(logits, t, top_k, top_p, u, with_kept=True, all_plain=True)
    for a, b in zip(got, want):
        assert torch.equal(a, b)


@needs_kernels
@pytest.mark.parametrize("name", ["tiny-random", "tiny-random-qwen2"])
def test_generate_is_the_same_with_the_tensor_op_bookkeeping(name):
    """Whole generate calls with stop ids, stop strings, caps, greedy, top-k/top-p and plain rows, n > 1: the C++
    bookkeeping and the tensor ops give the same tokens, log-probs, kept counts and finish reasons; the counters
    that pick the shortcuts return to zero."""
    model, tok = load_model(name).eval(), load_tokenizer("tiny-random")
    prompts = [[5, 6, 7], list(range(10, 27)), [900, 3, 44, 17, 8, 250, 9, 11, 64]]
    free = Engine(model, tok, EngineConfig(max_num_seqs=8, max_model_len=96, kv_cache_mb=8)).generate(
        [Request(prompts[1], SamplingParams(temperature=0, max_new_tokens=12, ignore_eos=True))])[0].samples[0]
    needle = tok.decode(free.token_ids[:6])[-2:]
    batches = [
        [Request(p, SamplingParams(n=4, temperature=1.0, max_new_tokens=10 + 3 * i, seed=i, ignore_eos=True))
         for i, p in enumerate(prompts)],
        [Request(prompts[0], SamplingParams(n=3, temperature=0.9, max_new_tokens=20, stop_token_ids=[free.token_ids[3], 11], seed=5)),
         Request(prompts[1], SamplingParams(temperature=0, max_new_tokens=12, stop_strings=[needle], ignore_eos=True)),
         Request(prompts[2], SamplingParams(n=2, temperature=1.1, top_p=0.9, max_new_tokens=15, seed=7))],
        [Request(prompts[0], SamplingParams(n=2, temperature=1.0, max_new_tokens=15, seed=8)),  # top-k is the only cut
         Request(prompts[2], SamplingParams(n=2, temperature=0.8, top_k=5, max_new_tokens=15, seed=6))],
    ]
    stopped = False
    for reqs in batches:
        runs = []
        for host in (True, False):
            eng = Engine(model, tok, EngineConfig(max_num_seqs=8, max_model_len=96, kv_cache_mb=8))
            eng.runner.step_kernels = host
            outs = eng.generate(reqs)
            assert eng._unplain == 0 and eng._reporting == 0
            runs.append([(s.token_ids, s.logprobs, s.kept_counts, s.finish_reason, s.stop_reason) for o in outs for s in o.samples])
        assert runs[0] == runs[1]
        stopped = stopped or any(r[3] == "stop" for r in runs[0])
    assert stopped
    top_k_only = runs[0][-2:]  # drawn from the 5 most likely tokens: kept counts of 5 (the plain shortcut gives none)
    assert all(r[2] == [5] * len(r[0]) for r in top_k_only)
