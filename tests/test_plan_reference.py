"""Every reference value of docs/planner.md ("Reference values"), each within 2% unless noted."""

import math

import pytest

from posttrain.plan import cost, predict
from posttrain.plan.methods import method_table, models_in_memory

GB, KIB, TIB = 1e9, 2**10, 2**40


def approx(x):
    return pytest.approx(x, rel=0.02)


# ---------------------------------------------------------------- memory (seeds use nominal 8B / 70B)


def test_ppo_8b_is_288_gb_from_128_128_16_16():
    p = predict(8e9, "ppo")
    assert p["memory_bytes_total"] == approx(288 * GB)
    by_role = {m["role"]: m["bytes"] for m in p["models"]}
    assert by_role == {"policy": approx(128 * GB), "value": approx(128 * GB), "reference": approx(16 * GB),
                       "reward": approx(16 * GB)}


def test_grpo_8b_is_160_gb():
    assert predict(8e9, "grpo")["memory_bytes_total"] == approx(160 * GB)


def test_ppo_70b_is_2520_gb():
    assert predict(70e9, "ppo")["memory_bytes_total"] == approx(2520 * GB)


def test_grpo_70b_is_1400_gb():
    assert predict(70e9, "grpo")["memory_bytes_total"] == approx(1400 * GB)


def test_dpo_70b_with_precomputed_reference_is_1120_gb():
    assert predict(70e9, "dpo")["memory_bytes_total"] == approx(1120 * GB)
    # holding the reference instead adds it at 2 B/param
    assert predict(70e9, "dpo", precompute_ref=False)["memory_bytes_total"] == approx(1260 * GB)


def test_dpo_with_lora_reference_is_the_base_under_20_gb():
    # with LoRA the reference is the base with the adapter disabled (≈ 20 GB at 8B instead of 128 GB)
    p = predict("llama-3-8b", "dpo", lora_r=16, precompute_ref=False)
    ref = next(m for m in p["models"] if m["role"] == "reference")
    assert ref["bytes"] == 0 and ref["shared_with"] == "policy"
    assert 16 * GB < p["memory_bytes_total"] < 20 * GB


# ---------------------------------------------------------------- run time


def test_sft_8b_2b_tokens_is_67_gpu_hours_at_40_percent_mfu_on_h100():
    p = predict(8e9, "sft", tokens=2e9, hardware="h100", mfu=0.4)
    assert p["run"]["flops"] == approx(9.6e19)  # 6·N·D
    assert p["run"]["gpu_hours"] == approx(67)
    assert predict(8e9, "sft", tokens=2e9, peak_flops=989e12)["run"]["gpu_hours"] == approx(67)


def test_sft_70b_2b_tokens_is_590_gpu_hours():
    p = predict(70e9, "sft", tokens=2e9, hardware="h100")
    assert p["run"]["flops"] == approx(8.4e20)
    assert p["run"]["gpu_hours"] == approx(590)


def test_seconds_per_step_divides_by_devices():
    one = predict(8e9, "sft", batch=64, seq_len=4096, hardware="h100")
    eight = predict(8e9, "sft", batch=64, seq_len=4096, hardware="h100", devices=8)
    assert one["seconds_per_step"] == pytest.approx(6 * 8e9 * 64 * 4096 / (989e12 * 0.4))
    assert eight["seconds_per_step"] == pytest.approx(one["seconds_per_step"] / 8)


# ---------------------------------------------------------------- tokens and FLOPs per step


def test_grpo_step_256x16x2000_is_8_19m_tokens_and_7_9e17_flops():
    p = predict(8e9, "grpo", batch=256, group=16, seq_len=2000)
    assert p["tokens_per_step"] == 8_192_000
    assert p["flops_per_step"] == approx(7.9e17)
    # generation 2N is a sixth, training 6N half
    split = {ph["phase"]: ph["flops_per_step"] / p["flops_per_step"] for ph in p["phases"]}
    assert split["generate"] == pytest.approx(1 / 6) and split["train"] == pytest.approx(1 / 2)


def test_rl_step_512x8x1000_is_4_1m_tokens():
    assert predict(8e9, "grpo", batch=512, group=8, seq_len=1000)["tokens_per_step"] == approx(4.1e6)


def test_reasoning_step_512x16x16k_is_134m_tokens_and_16_tib_kv():
    p = predict("llama-3-8b", "rlvr", batch=512, group=16, seq_len=16 * 1024)
    assert p["tokens_per_step"] == approx(134e6)
    assert p["kv_bytes_step"] == 16 * TIB  # 2^27 tokens × 128 KiB
    assert p["kv_bytes_per_token"] == 128 * KIB


@pytest.mark.parametrize("method,extra,multiple", [
    ("sft", {}, 6), ("rm", {}, 6), ("dpo", {}, 8), ("grpo", {}, 12), ("ppo", {}, 20),
    ("grpo", {"reward": "verifier"}, 10), ("grpo", {"reward": "verifier", "beta": 0}, 8),
    ("ppo", {"reward": "verifier"}, 18), ("rlvr", {}, 8), ("rlvr", {"beta": 0.01}, 10),
])
def test_flops_per_token_multiples_of_n(method, extra, multiple):
    assert predict(8e9, method, **extra)["flops_per_token"] == pytest.approx(multiple * 8e9)


def test_on_policy_distillation_with_a_larger_teacher():
    # student generates 2N_s, teacher scores 2N_T, student trains 6N_s
    p = predict(1e9, "distill", teacher=7e10, batch=4, group=2, seq_len=100)
    assert p["flops_per_token"] == pytest.approx(8 * 1e9 + 2 * 7e10)
    assert [m["role"] for m in p["models"]] == ["policy", "teacher"]
    assert p["memory_bytes_total"] == pytest.approx(16 * 1e9 + 2 * 7e10)
    assert predict(1e9, "distill", distill="sequence", teacher=7e10)["flops_per_token"] == pytest.approx(6e9 + 2 * 7e10)


def test_lora_training_skips_frozen_weight_gradients():
    full = predict("qwen2.5-0.5b", "sft")
    lora = predict("qwen2.5-0.5b", "sft", lora_r=16)
    n, a = full["params"], lora["lora"]["params"]
    # forward 2 + activation grads 2 + weight grads 2 only for the adapter's share
    assert lora["flops_per_token"] == pytest.approx((4 + 2 * a / (n + a)) * (n + a))
    assert lora["memory_bytes_total"] == pytest.approx(2 * n + 16 * a)


# ---------------------------------------------------------------- agents (seed 002: 第六篇, exercise A9)


def test_agent_10_turns_400_generated_3000_returned():
    # 10 × 400 + 9 × 3000 = 31K context; 4000 generated ≈ 13%; 31000 / 4000 = 7.75× per useful token
    a = predict(8e9, "agent", turns=10, seq_len=400, return_len=3000)["agent"]
    assert a["context_tokens"] == 31_000
    assert a["generated_share"] == pytest.approx(0.13, abs=0.005)
    assert a["cost_per_useful_token"] == pytest.approx(7.75)


def test_agent_20_turns_500_generated_2000_returned():
    # 48K context, 10K generated ≈ 20%, ≈ 5× per useful token; prefix caching: prefill 480K → 48K
    a = predict(8e9, "agent", turns=20, seq_len=500, return_len=2000)["agent"]
    assert a["context_tokens"] == 48_000
    assert a["generated_tokens"] == 10_000
    assert a["generated_share"] == pytest.approx(0.20, abs=0.01)
    assert a["cost_per_useful_token"] == pytest.approx(5, rel=0.05)  # 4.8; the seed rounds to 5
    assert a["prefill_tokens_no_cache"] == approx(480_000)
    assert a["prefill_tokens_prefix_cache"] == 48_000


def test_agent_flops_per_useful_token_is_context_over_generated():
    p = predict(8e9, "agent", batch=2, group=4, turns=10, seq_len=400, return_len=3000)
    assert p["agent"]["flops_per_useful_token"] == pytest.approx(p["flops_per_token"] * 7.75)
    assert p["tokens_per_step"] == 2 * 4 * 31_000


# ---------------------------------------------------------------- distillation storage


def test_top64_storage_is_256_bytes_vs_256_kb_full_bf16():
    assert cost.logit_bytes_per_token(128 * 1024, top_k=64) == 256  # 64 × (2-byte id + 2-byte log-prob)
    assert cost.logit_bytes_per_token(128 * 1024) == 256 * KIB  # 128K × 2 bytes
    d = predict("qwen2.5-0.5b", "distill", teacher="llama-3-8b")["distill"]
    assert d["logit_bytes_per_token_topk"] == 256
    assert d["logit_bytes_per_token_full"] == approx(256e3)  # Llama-3's 128,256 tokens × 2 B


# ---------------------------------------------------------------- best-of-N KL


@pytest.mark.parametrize("n,nats", [(4, 0.64), (16, 1.83), (64, 3.17), (256, 4.55), (10, 1.40), (30, 2.43)])
def test_bon_kl_bound(n, nats):
    assert cost.bon_kl(n) == pytest.approx(nats, abs=0.006)


def test_rejection_sampling_reports_the_bound_and_trains_on_the_kept_sample():
    p = predict(8e9, "rs", group=16)
    assert p["bon_kl_nats"] == pytest.approx(math.log(16) - 15 / 16)
    assert p["flops_per_token"] == pytest.approx((2 + 2 + 6 / 16) * 8e9)  # generate, score, SFT on 1 of 16


# ---------------------------------------------------------------- evaluation intervals


def test_aime_30_items_is_plus_minus_18_points():
    assert 100 * cost.ci95_half_width(0.5, 30) == approx(18)


def test_500_items_is_plus_minus_4_4_points():
    assert 100 * cost.ci95_half_width(0.5, 500) == approx(4.4)


def test_1000_items_is_plus_minus_3_points():
    # p = 0.5 gives 3.10: the seeds state one significant digit
    assert round(100 * cost.ci95_half_width(0.5, 1000)) == 3
    assert 100 * cost.ci95_half_width(0.5, 1000) == pytest.approx(3, rel=0.035)


def test_mmlu_14042_items_is_plus_minus_0_8_points():
    # p = 0.5 gives 0.83: the seeds state one significant digit
    assert round(100 * cost.ci95_half_width(0.5, 14042), 1) == 0.8
    assert 100 * cost.ci95_half_width(0.5, 14042) == pytest.approx(0.8, rel=0.035)


def test_gpqa_198_items():
    assert 100 * cost.ci95_half_width(0.5, 198) == approx(7)  # seed: ±7
    assert 100 * cost.ci95_half_width(0.8, 198) == approx(5.6)  # seed exercise: 82% vs 78% → ±5.6
    assert predict(8e9, eval_n=198, eval_p=0.8)["eval"]["ci95_half_width"] == approx(0.056)


# ---------------------------------------------------------------- the method table (`posttrain methods`)


@pytest.mark.parametrize("method,options,count", [
    ("sft", {}, 1), ("rm", {}, 1), ("rs", {}, 2), ("rs", {"reward": "verifier"}, 1),
    ("ppo", {}, 4), ("grpo", {}, 3), ("grpo", {"reward": "verifier"}, 2),
    ("grpo", {"reward": "verifier", "beta": 0.0}, 1), ("grpo", {"beta": 0.0}, 2),
    ("dpo", {"precompute_ref": False}, 2), ("dpo", {}, 1),
    ("rlvr", {}, 1), ("rlvr", {"beta": 0.01}, 2), ("agent", {}, 1), ("agent", {"beta": 0.01}, 2),
    ("distill", {}, 2),
])
def test_models_in_memory(method, options, count):
    assert models_in_memory(method, **options) == count
    assert predict(8e9, method, **options)["models_in_memory"] == count


def test_beta_zero_drops_the_reference_and_a_verifier_drops_the_reward_model():
    roles = [m["role"] for m in predict(8e9, "grpo", beta=0, reward="verifier")["models"]]
    assert roles == ["policy"]
    assert [m["role"] for m in predict(8e9, "grpo")["models"]] == ["policy", "reference", "reward"]


def test_method_table_rows_match_spec_section_0():
    rows = {r["method"]: r["models in memory"] for r in method_table()}
    assert rows["sft"] == "1" and rows["rm"] == "1" and rows["distill"] == "2"
    assert rows["ppo"].startswith("4")
    assert rows["grpo"] == "3 (2 with verifier, 1 with verifier and β=0)"
    assert rows["dpo"] == "1 (2 without precomputed reference log-probs)"
    assert rows["rlvr"].startswith("1 (2 with β>0")
