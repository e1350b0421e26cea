"""Device handling without a GPU: resolving the `device` key, Hub ids, and every CPU-only fast path
chosen by the tensors' own device. The `meta` device stands in for "not the CPU": tensors there have
shapes and dtypes but no data, so a CPU-only kernel reached by mistake fails loudly."""

import pytest
import torch

from posttrain.config import ConfigError, build
from posttrain.data.packing import Batch, collate
from posttrain.data.templates import Tokenized
from posttrain.errors import UserError
from posttrain.models import loading
from posttrain.models.device import is_cpu, resolve_device
from posttrain.ops import cpu_kernels
from posttrain.ops.attention import attention_dtypes
from posttrain.recipes.sft import SFTConfig

no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message shown without CUDA")


# ---------------------------------------------------------------- resolve_device / config key


def test_resolve_device_cpu_and_auto():
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device(" CPU ") == torch.device("cpu")
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert resolve_device().type == expected
    assert resolve_device(torch.device("cpu")) == torch.device("cpu")


@no_cuda
@pytest.mark.parametrize("name", ["cuda", "cuda:1"])
def test_cuda_without_cuda_is_a_clear_user_error(name):
    with pytest.raises(UserError, match=rf"device={name}: CUDA is not available here .*use device=cpu or device=auto"):
        resolve_device(name)


@pytest.mark.parametrize("name", ["gpu", "cuda:x", "mps0", ""])
def test_unknown_device_names_are_refused(name):
    with pytest.raises(UserError, match="unknown device"):
        resolve_device(name)


def test_is_cpu_reads_devices_names_and_tensors():
    assert is_cpu("cpu") and is_cpu(torch.device("cpu")) and is_cpu(torch.zeros(1))
    assert not is_cpu("cuda:0") and not is_cpu(torch.zeros(1, device="meta"))


def test_config_device_key():
    assert SFTConfig().device == "auto"
    assert build(SFTConfig, {"device": "cuda:3"}).device == "cuda:3"  # validated here, resolved at run time
    with pytest.raises(ConfigError, match="device"):
        build(SFTConfig, {"device": "gpu"})


@no_cuda
def test_sft_refuses_cuda_before_any_work(tmp_path):
    from posttrain.recipes.sft import train

    with pytest.raises(UserError, match="CUDA is not available"):
        train(SFTConfig(device="cuda", output_dir=str(tmp_path / "run"), max_steps=1))
    assert not (tmp_path / "run").exists()


# ---------------------------------------------------------------- Hub ids


def test_hub_id_detection(tmp_path, monkeypatch):
    assert loading.is_hub_id("HuggingFaceTB/SmolLM2-135M-Instruct")
    assert not loading.is_hub_id("tiny-random") and not loading.is_hub_id("runs/sft/final")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "org").mkdir()
    (tmp_path / "org" / "name").write_text("")  # an existing path is never a Hub id
    assert not loading.is_hub_id("org/name")


def test_uncached_hub_id_offline_is_a_user_error(monkeypatch):
    import huggingface_hub.constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)  # read at import time
    name = "posttrain-tests-no-such-org/no-such-model-7f3a"
    expected = (rf"model '{name}' is neither a local folder, a built-in name, nor in the Hugging Face cache, "
                r"and the Hub could not be reached: \w+.* \(HF_HUB_OFFLINE is set: no downloads\)$")
    for load in (loading.load_model, loading.load_tokenizer):
        with pytest.raises(UserError, match=expected) as err:
            load(name)
        assert "\n" not in str(err.value)  # the underlying reason on the same line


def test_hub_id_is_passed_to_from_pretrained(monkeypatch, tiny_tok):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from posttrain.models.builtin import build_tiny

    seen = []

    def fake_model(name, **kwargs):
        seen.append(("model", name, kwargs.get("dtype")))
        return build_tiny("tiny-random")

    def fake_tok(name, **kwargs):
        seen.append(("tokenizer", name, None))
        return tiny_tok

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", fake_model)
    monkeypatch.setattr(AutoTokenizer, "from_pretrained", fake_tok)
    model = loading.load_model("some-org/some-model", dtype="bfloat16", device="cpu")
    loading.load_tokenizer("some-org/some-model")
    assert seen == [("model", "some-org/some-model", torch.bfloat16), ("tokenizer", "some-org/some-model", None)]
    from posttrain.ops.attention import NAME

    assert model.config._attn_implementation == NAME


def test_other_missing_names_still_say_what_is_accepted():
    with pytest.raises(UserError, match=r"not found: give an HF folder, a built-in name .* or a Hub id"):
        loading.resolve("no/such/folder")


# ---------------------------------------------------------------- model, batches, kernels by device


def test_load_model_moves_to_the_device():
    model = loading.load_model("tiny-random", device="cpu")
    assert {p.device for p in model.parameters()} == {torch.device("cpu")}
    with pytest.raises(UserError, match="unknown device"):
        loading.load_model("tiny-random", device="tpu")


def test_batch_to_moves_every_tensor():
    rows = [[Tokenized([5, 6, 7], [0, 1, 1])], [Tokenized([5, 6], [0, 1])]]
    for packed in (True, False):
        b = collate(rows, pad_id=0, packed=packed)
        assert b.to("cpu") is b
        m = b.to("meta")
        tensors = [m.input_ids, m.position_ids, m.targets] + ([] if packed else [m.attention_mask])
        assert all(t.device.type == "meta" for t in tensors)
        assert (m.attention_mask is None) == packed
        assert (m.num_tokens, m.num_padding, m.row_tokens) == (b.num_tokens, b.num_padding, b.row_tokens)
        assert isinstance(m, Batch) and b.input_ids.device.type == "cpu"  # the original is unchanged


def test_cpu_kernels_take_the_eager_path_off_cpu():
    # bf16 contiguous rows: the fused kernels' case on CPU; on another device they must not be reached
    x = torch.empty(4, 64, dtype=torch.bfloat16, device="meta")
    w = torch.empty(64, dtype=torch.bfloat16, device="meta")
    assert not cpu_kernels._usable(x, w)
    assert cpu_kernels.rmsnorm(x, w, 1e-6).device.type == "meta"
    q = torch.empty(4, 3, 16, dtype=torch.bfloat16, device="meta")
    cs = torch.empty(4, 16, dtype=torch.bfloat16, device="meta")
    assert cpu_kernels.rope(q, cs, cs).shape == (4, 3, 16)


def test_cpu_kernels_fused_equals_eager_on_cpu():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(8, 64, generator=g).bfloat16()
    w = (torch.rand(64, generator=g) + 0.5).bfloat16()
    diff = (cpu_kernels.rmsnorm(x, w, 1e-6).float() - cpu_kernels.rmsnorm_ref(x, w, 1e-6).float()).abs()
    assert (diff <= cpu_kernels.rmsnorm_ref(x, w, 1e-6).float().abs() * 2**-6).all()  # a bf16 ulp or two at most
    q = torch.randn(8, 3, 16, generator=g).bfloat16()
    cos, sin = torch.randn(8, 16, generator=g).bfloat16(), torch.randn(8, 16, generator=g).bfloat16()
    assert torch.equal(cpu_kernels.rope(q, cos, sin), cpu_kernels.rope_ref(q, cos, sin))


def test_onednn_packing_only_for_cpu_weights():
    from posttrain.rollout.runner import _onednn_pack

    assert _onednn_pack(torch.empty(8, 4, device="meta"), 4) is None


def test_varlen_attention_dtypes_by_device():
    f32, bf16, f16 = torch.float32, torch.bfloat16, torch.float16
    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)  # a device object needs no GPU
    assert attention_dtypes(cpu, f32, f32, bf16) == (f32, bf16)  # CPU: fp32 compute (faster backward), bf16 out
    assert attention_dtypes(cpu, f32, f32, f32) == (f32, f32)
    assert attention_dtypes(cuda, f32, f32, bf16) == (bf16, bf16)  # CUDA: one 16-bit dtype, flash kernels
    assert attention_dtypes(cuda, f32, f32, f32) == (f32, f32)
    assert attention_dtypes(cuda, f16, f16, f16) == (f16, f16)


def test_engine_buffers_live_on_the_models_device(tiny_tok):
    from posttrain.rollout.engine import Engine, EngineConfig
    from posttrain.rollout.types import Request, SamplingParams

    model = loading.load_model("tiny-random", varlen_attention=False, device="cpu").eval()
    engine = Engine(model, tiny_tok, EngineConfig(max_num_seqs=4, max_model_len=64, kv_cache_mb=1))
    engine.generate([Request([5, 6, 7], SamplingParams(n=2, max_new_tokens=4, seed=0))])
    device = next(model.parameters()).device
    found = {n: t.device for obj in (engine, engine.runner) for n, t in vars(obj).items() if isinstance(t, torch.Tensor)}
    assert {"tables", "out_tok", "out_lp", "temp", "k_cache", "v_cache", "cos", "k_slot"} <= set(found)
    assert set(found.values()) == {device}, found
