"""Multi-turn rollout: exact loss masks (SmolLM2 and Qwen2.5 templates), no re-tokenisation, prefix reuse
on the engine, `posttrain rl env=...`, `posttrain eval env=...`, the planner's agent prediction."""

import copy
import json
from pathlib import Path

import pytest

from posttrain.agentic.formats import TagFormat, TemplateFormat, make_format
from posttrain.agentic.rollout import new_episodes, run_episodes
from posttrain.agentic.settings import AgentSettings
from posttrain.agentic.tools import calculator_tool
from posttrain.rollout.settings import SamplingSettings
from posttrain.rollout.trajectory import make_batches
from tests.agentic_envs import CalcEnv, FixedEnv, ScriptedBackend
from tests.conftest import COUNT_PROMPTS, write_jsonl
from tests.test_templates import SMOLLM2

QWEN25 = (Path(__file__).parent / "data" / "qwen2_5_chat_template.jinja").read_text()  # Qwen2.5-Instruct, verbatim


def with_template(tok, template):
    tok = copy.deepcopy(tok)
    tok.chat_template = template
    return tok


def enc(tok, text):
    return tok(text, add_special_tokens=False)["input_ids"]


def char_ids(tok, text):
    """The text as one token per character: decodes to `text` but is NOT how the tokenizer encodes it."""
    return [i for ch in text for i in enc(tok, ch)]


# the three model turns of the episode: two calculator calls, then the answer
CALLS = {"template": ['<tool_call>\n{"name": "calculator", "arguments": {"expression": "17 * 23"}}\n</tool_call>',
                      '<tool_call>\n{"name": "calculator", "arguments": {"expression": "391 + 0"}}\n</tool_call>'],
         "tag": ["<tool>calculator: 17 * 23</tool>", "<tool>calculator: 391 + 0</tool>"]}
FINAL = "The answer is 391."
# hand-written template glue around the tool output "391"
GLUE = {"template": ("<|im_end|>\n<|im_start|>user\n<tool_response>\n", "\n</tool_response><|im_end|>\n<|im_start|>assistant\n"),
        "tag": ("<|im_end|>\n<|im_start|>tool\n", "<|im_end|>\n<|im_start|>assistant\n")}


@pytest.mark.parametrize("template,kind", [(SMOLLM2, "tag"), (QWEN25, "template")], ids=["smollm2", "qwen2.5"])
def test_three_turn_mask_is_exactly_the_models_tokens(tiny_tok, template, kind):
    tok = with_template(tiny_tok, template)
    fmt = make_format(tok, [calculator_tool()])
    assert isinstance(fmt, TemplateFormat if kind == "template" else TagFormat)
    eos = tok.eos_token_id
    # the model's turns as the engine would return them, deliberately not in the tokenizer's canonical form
    turns = [char_ids(tok, CALLS[kind][0]), char_ids(tok, CALLS[kind][1]), char_ids(tok, FINAL) + [eos]]
    for t in turns:
        assert enc(tok, tok.decode(t, skip_special_tokens=True)) != [x for x in t if x != eos]  # re-encoding would change them
    backend = ScriptedBackend(turns, eos)
    groups = new_episodes(CalcEnv, [{}], 1, fmt, seed=0)
    run_episodes(backend, fmt, groups, AgentSettings(max_turns=3), SamplingSettings(max_new_tokens=64), tok)
    ep = groups[0][0]
    assert ep.finish_reason == "answer" and len(ep.turns) == 3 and ep.reward == 1.0
    assert [c["output"] for c in ep.tool_calls] == ["391", "391"]
    # the expected response and mask, built by hand
    before, after = GLUE[kind]
    obs = enc(tok, before) + enc(tok, "391") + enc(tok, after)
    expected_ids = turns[0] + obs + turns[1] + obs + turns[2]
    expected_mask = [1] * len(turns[0]) + [0] * len(obs) + [1] * len(turns[1]) + [0] * len(obs) + [1] * len(turns[2])
    assert ep.response_ids == expected_ids
    assert ep.loss_mask() == expected_mask
    # what the engine was sent each turn: the concatenated ids, never a re-rendered conversation
    prompt = enc(tok, tok.apply_chat_template(fmt.prompt_messages([{"role": "user", "content": "What is 17 * 23?"}]),
                                              tokenize=False, add_generation_prompt=True, **(
                                                  {"tools": [t.schema() for t in fmt.tools]} if kind == "template" else {})))
    assert ep.prompt_ids == prompt
    assert backend.prompts == [prompt, prompt + turns[0] + obs, prompt + turns[0] + obs + turns[1] + obs]
    # the trainer's targets are exactly the model's tokens, with their behaviour log-probs
    traj = ep.to_trajectory(tok)
    (batch,) = make_batches([traj], tok.pad_token_id, 4096)
    assert batch.targets.tolist() == turns[0] + turns[1] + turns[2]
    assert traj.behaviour_logp.tolist() == [-0.5] * len(batch.targets)


def test_observation_after_an_eos_does_not_repeat_it(tiny_tok):
    tok = with_template(tiny_tok, QWEN25)
    fmt = make_format(tok, [calculator_tool()])
    with_eos = fmt.observation_ids("7", after_eos=True)
    assert with_eos == enc(tok, "\n<|im_start|>user\n<tool_response>\n") + enc(tok, "7") + enc(tok, GLUE["template"][1])
    assert fmt.observation_ids("7", after_eos=False)[0] == tok.eos_token_id
    assert len(fmt.observation_ids("x " * 500, False, max_tokens=10)) == len(fmt.observation_ids("", False)) + 10


def test_parse_tool_calls(tiny_tok):
    tok = with_template(tiny_tok, QWEN25)
    fmt = make_format(tok, [calculator_tool()])
    (c,) = fmt.parse('x <tool_call>\n{"name": "calculator", "arguments": "{\\"expression\\": \\"2+2\\"}"}\n</tool_call>')
    assert (c.name, c.arguments, c.error) == ("calculator", {"expression": "2+2"}, None)
    (bad,) = fmt.parse("<tool_call>{not json}</tool_call>")
    assert bad.error and "JSON" in bad.error
    tag = make_format(with_template(tiny_tok, SMOLLM2), [calculator_tool()])
    assert [(c.name, c.arguments) for c in tag.parse("a <tool>calculator: 3*4</tool> b <tool>nothing</tool>")][0] == \
        ("calculator", {"expression": "3*4"})
    assert tag.parse("<tool>nothing</tool>")[0].error
    assert tag.parse("no call here") == []
    with pytest.raises(Exception, match="no <tool_call>"):
        make_format(tag.tok, [calculator_tool()], "template")


# ---------------------------------------------------------------- prefix reuse on the engine


@pytest.fixture(scope="module")
def tiny_engine(tiny_tok):
    from posttrain.models.loading import load_model
    from posttrain.rollout.engine import Engine, EngineConfig

    return Engine(load_model("tiny-random"), tiny_tok, EngineConfig(max_num_seqs=8, kv_cache_mb=64, block_size=16))


def test_ten_turn_prefill_stays_near_final_context(tiny_engine, tiny_tok):
    """Cumulative prefill of a 10-turn episode ≈ its final context, not the sum of the turns' prompts."""
    fmt = make_format(tiny_tok, FixedEnv.tools)
    groups = new_episodes(FixedEnv, [{"prompt": "Count to ten."}], 1, fmt, seed=3)
    tiny_engine.reset_prefix_cache()
    settings = AgentSettings(max_turns=10, max_total_tokens=1500, max_observation_tokens=40)
    stats = run_episodes(tiny_engine, fmt, groups, settings, SamplingSettings(max_new_tokens=16, ignore_eos=True), tiny_tok)
    ep = groups[0][0]
    assert len(ep.turns) == 10 and ep.finish_reason == "max_turns"
    context = len(ep.prompt_ids) + len(ep.response_ids)
    prompts = [len(ep.prompt_ids) + s for s, _ in ep.spans]  # each turn's request length
    no_cache = sum(prompts)
    generated = sum(t.generated for t in ep.turns)
    bs = tiny_engine.config.block_size
    print(f"\n10-turn episode: final context {context} tokens; cumulative prefill {stats.prefill_tokens} "
          f"(+ {generated} decoded); without the prefix cache {no_cache} (x{no_cache / stats.prefill_tokens:.1f})")
    assert stats.prefill_tokens <= context
    # each turn recomputes at most its last partial block (and the last sampled token) besides the new observation
    assert stats.prefill_tokens + generated <= context + 10 * bs
    assert no_cache > 4 * stats.prefill_tokens


# ---------------------------------------------------------------- recipes


def _rl(tmp_path, *overrides):
    from posttrain.config import parse_args
    from posttrain.recipes import rl

    data = write_jsonl(tmp_path / "prompts.jsonl", COUNT_PROMPTS)
    cfg = parse_args(rl.RLConfig, ["model=tiny-random", f"data={data}", f"output_dir={tmp_path / 'run'}",
                                   "env=tests/agentic_envs.py:FixedEnv", "prompts_per_step=2", "group_size=4",
                                   "max_new_tokens=8", "optim.lr=1e-4", "max_steps=2", "progress=false", *overrides])
    return rl.train(cfg), tmp_path / "run"


def test_rl_env_trains_on_model_tokens_and_plan_matches(tmp_path):
    summary, run = _rl(tmp_path, "ignore_eos=true", "agent.max_turns=3", "agent.max_observation_tokens=20")
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2 and all(r["agent/turns"] == 3 and r["agent/finish/max_turns"] == 1 for r in rows)
    assert all(r["agent/generated_tokens"] == 24 for r in rows) and rows[0]["grad_norm"] > 0
    eps = [json.loads(line) for line in (run / "episodes.jsonl").read_text().splitlines()]
    seg = eps[0]["segments"]
    assert [s["loss"] for s in seg] == [1, 0, 1, 0, 1] and "tool output" in seg[1]["text"]
    plan = json.loads((run / "plan.json").read_text())
    ratio = plan["comparison"]["tokens_per_step_over_predicted"]
    agent = plan["predicted"]["agent"]
    print(f"\nplanner: {agent['turns']} turns x ({plan['predicted']['generated_tokens_per_step'] // 8 // 3} generated + "
          f"returned) -> {plan['predicted']['tokens_per_step']} tokens/step; measured/predicted = {ratio:.3f}")
    assert 0.9 <= ratio <= 1.1


def test_rl_env_plan_check_with_variable_lengths(tmp_path):
    """Without ignore_eos turns vary in length: agent_plan.json's formula at the measured means stays within 10 %."""
    _, run = _rl(tmp_path, "agent.max_turns=3", "max_new_tokens=12")
    doc = json.loads((run / "agent_plan.json").read_text())
    assert 0.9 <= doc["context_over_predicted"] <= 1.1, doc


def test_eval_env_writes_results_that_compare(tmp_path, capsys):
    from posttrain.cli import main

    data = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "What is 17 * 23?", "answer": "391"}, {"prompt": "2 * 3?", "answer": "6"}])
    for name in ("a", "b"):
        assert main(["eval", "env=calculator", f"data={data}", "n=2", "max_new_tokens=8", "agent.max_turns=2",
                     f"output_dir={tmp_path / name}", "seed=1"]) == 0
    doc = json.loads((tmp_path / "a" / "results.json").read_text())
    assert {"pass@1", "pass^2"} <= set(doc["metrics"])
    assert doc["agent"]["turns_histogram"] and "env_s" in doc["timing"] and "model_s" in doc["timing"]
    t = doc["timing"]  # the engine over the episodes (rollout.signals): 2 problems x 2 episodes, <= 2 turns of <= 8 tokens
    assert 4 <= t["engine/generated_tokens"] <= 2 * 2 * 2 * 8
    assert t["engine/tokens_per_s"] > 0 and t["engine/preemptions"] == 0 and 0 < t["engine/kv_peak_frac"] <= 1
    assert doc["items"][0]["n"] == 2 and len(doc["items"][0]["correct"]) == 2
    assert "class=m1" in (tmp_path / "a" / "report.html").read_text()
    assert main(["eval", "compare", str(tmp_path / "a"), str(tmp_path / "b")]) == 0
    assert "B − A = +0.0000" in capsys.readouterr().out
