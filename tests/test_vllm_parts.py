"""The parts of backend=vllm that need no vLLM (they run in `make test`): kept-set sizes read off behaviour log-probs,
the merged (LoRA) state dict pushed to vLLM's workers. The backend itself: tests/test_vllm_backend.py (make test-vllm)."""

import pytest
import torch

from posttrain.models.loading import load_model
from posttrain.ops.sampling import kept_from_logprobs, kept_logprobs, process_logits
from posttrain.rollout.vllm_backend import merged_state_dict


@pytest.mark.parametrize("temperature,top_k,top_p", [(0.7, 0, 0.9), (1.0, 20, 1.0), (1.3, 50, 0.95), (0.5, 3, 0.8)])
def test_kept_sizes_from_behaviour_logprobs(temperature, top_k, top_p):
    """A sampler's processed log-probs on logits z (M, V); the trainer sees z + noise (another kernel's rounding). The
    size read off each log-prob is the true set size, and kept_logprobs over it reproduces the log-prob to the noise."""
    g = torch.Generator().manual_seed(0)
    z = torch.randn(300, 1024, generator=g) * 3
    lp = process_logits(z, temperature, top_k, top_p)
    t = torch.multinomial(lp.exp(), 1, generator=g).squeeze(1)
    behaviour = lp.gather(1, t[:, None]).squeeze(1)
    noisy = z + 1e-5 * torch.randn(z.shape, generator=g)
    kept = kept_from_logprobs(noisy, temperature, t, behaviour)
    assert torch.equal(kept, torch.isfinite(lp).sum(-1))
    assert (kept_logprobs(noisy, temperature, kept, t)[0] - behaviour).abs().max() < 1e-4


def test_kept_size_one_for_a_certain_token():
    z = torch.tensor([[10.0, 0.0, -1.0, -2.0]])
    assert kept_from_logprobs(z, 1.0, torch.tensor([0]), torch.tensor([0.0])).tolist() == [1]


def test_merged_state_dict_is_what_merge_and_unload_writes():
    from peft import LoraConfig, get_peft_model

    model = load_model("tiny-random", varlen_attention=False)
    plain = {k: v.clone() for k, v in merged_state_dict(model).items()}  # merge_and_unload writes in place
    assert set(plain) == {n for n, _ in model.named_parameters()} | {"lm_head.weight"}  # tied: both names
    peft = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    merged = merged_state_dict(peft)
    reference = peft.merge_and_unload().state_dict()
    assert set(merged) == set(reference)
    assert max((merged[k] - reference[k]).abs().max().item() for k in merged) < 1e-6
    assert (merged["model.layers.0.self_attn.q_proj.weight"] - plain["model.layers.0.self_attn.q_proj.weight"]).abs().max() > 1e-3
