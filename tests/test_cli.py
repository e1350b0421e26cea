"""`posttrain --help`: the command summaries stay in step with the registries, and the help stays fast."""

import subprocess
import sys

from posttrain import cli
from posttrain.algos import preference_losses
from posttrain.algos.presets import RL_PRESETS


def _listed(command: str) -> list[str]:
    summary = cli.COMMANDS[command][1]
    return [name.strip() for name in summary.split(":", 1)[1].split(",")]


def test_rl_summary_lists_every_preset_in_order():
    assert _listed("rl") == list(RL_PRESETS)


def test_dpo_summary_lists_every_preference_loss():
    assert sorted(_listed("dpo")) == sorted(preference_losses.names())


def test_help_imports_no_torch():
    code = "import sys, posttrain.cli as c; c.main(['--help']); assert 'torch' not in sys.modules, 'torch imported'"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "commands:" in out.stdout
