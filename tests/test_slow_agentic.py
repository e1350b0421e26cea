"""Slow: SmolLM2-135M-Instruct learns to use a calculator (3-digit x 2-digit multiplication): base ->
SFT warm-up on tool-use demonstrations -> GRPO in env=calculator (run by hand, alone:
`pytest -m slow -s tests/test_slow_agentic.py`; the steps are scripts/agentic_calculator.py)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from posttrain.models.builtin import real_model_dir

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not (real_model_dir("smollm2-135m-instruct") / "config.json").is_file(),
                       reason="run `posttrain models fetch smollm2-135m-instruct` first"),
]


@pytest.mark.timeout(5400)
def test_grpo_with_calculator_raises_success(tmp_path):
    root = Path(__file__).resolve().parent.parent
    subprocess.run([sys.executable, str(root / "scripts" / "agentic_calculator.py"), "--out", str(tmp_path)], check=True, cwd=root)
    res = {n: json.loads((tmp_path / n / "results.json").read_text()) for n in ("eval_base", "eval_sft", "eval_rl")}
    base, sft, rl = (res[n]["metrics"]["pass@1"]["value"] for n in ("eval_base", "eval_sft", "eval_rl"))
    tool = {n: res[n]["agent"].get("tool_correct") for n in res}
    print(f"\nsuccess: base {base:.3f}, SFT {sft:.3f}, SFT+GRPO {rl:.3f}; calculator called correctly: {tool}")
    assert base < 0.05  # the model cannot multiply 3 x 2 digits alone
    cmp = json.loads((tmp_path / "compare_base_rl.json").read_text())
    assert cmp["significant"] and rl > base
    gain = json.loads((tmp_path / "compare_sft_rl.json").read_text())  # what GRPO adds over the warm-up
    assert gain["significant"] and rl > sft
    assert tool["eval_rl"] > tool["eval_sft"] > tool["eval_base"]
