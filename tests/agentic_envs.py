"""Environments and a scripted backend for the agentic tests (loaded by path: env=tests/agentic_envs.py:Class)."""

from posttrain.agentic.env import Environment, ToolEnv
from posttrain.agentic.tools import calculator_tool, python_tool
from posttrain.rollout.types import Completion, RequestOutput

LONG_OBSERVATION = "tool output " * 200  # longer than any max_observation_tokens the tests use


class FixedEnv(Environment):
    """Answers every turn with the same long observation; the episode runs to max_turns.
    Reward: the share of the model's tokens that are even ids (deterministic, varies across samples)."""

    tools = [calculator_tool()]

    def reset(self, row, seed):
        return [{"role": "user", "content": row["prompt"] if isinstance(row["prompt"], str) else row["prompt"][-1]["content"]}]

    def step(self, action):
        return LONG_OBSERVATION, False, {}

    def reward(self, episode):
        ids = [episode.response_ids[j] for s, e in episode.spans for j in range(s, e)]
        return sum(i % 2 == 0 for i in ids) / len(ids)


class CalcEnv(ToolEnv):
    """Calculator tool; reward 1 when the final turn says 391."""

    def __init__(self):
        self.tools = [calculator_tool()]

    def reset(self, row, seed):
        return [{"role": "user", "content": "What is 17 * 23?"}]

    def reward(self, episode):
        return float("391" in episode.final_text)


class PyEnv(ToolEnv):
    """Python tool in the sandbox with short limits; the hidden test never leaves this object."""

    HIDDEN = "assert add(1, 2) == 3  # HIDDEN-TEST-7f3a"

    def __init__(self, wall_s=2.0):
        self.tools = [python_tool(wall_s=wall_s, cpu_s=2, memory_mb=512, nproc=16, output_bytes=4096)]

    def reset(self, row, seed):
        self.tests = [self.HIDDEN]
        return [{"role": "user", "content": "Write add(a, b)."}]

    def reward(self, episode):
        return 0.0


class ScriptedBackend:
    """A backend with `generate(requests)` that answers request i of the whole run with the next
    scripted turn (token ids), whatever the prompt. Records every prompt it was sent."""

    def __init__(self, turns: list[list[int]], eos: int):
        self.turns, self.eos, self.prompts = list(turns), eos, []
        self.default_eos = [eos]

    def generate(self, requests):
        outs = []
        for i, r in enumerate(requests):
            self.prompts.append(list(r.prompt_token_ids))
            samples = []
            for j in range(r.params.n):
                ids = self.turns.pop(0)
                reason = "stop"
                samples.append(Completion(j, list(ids), [-0.5] * len(ids), reason, None))
            outs.append(RequestOutput(i, list(r.prompt_token_ids), samples))
        return outs


class Echo:
    """The protocol and nothing more: reset/step/reward, no base class, no `tools`, no `bind` (a user's first env)."""

    def reset(self, row, seed):
        return [{"role": "user", "content": row["prompt"] if isinstance(row["prompt"], str) else row["prompt"][-1]["content"]}]

    def step(self, action):
        return None, True, {}

    def reward(self, episode):
        return float(len(episode.final_text) % 2)


class StringEcho(Echo):
    """reset returns a string: the first user message."""

    def reset(self, row, seed):
        return "Say something."


class DictReset(Echo):
    """reset returns one message instead of a list of them."""

    def reset(self, row, seed):
        return {"role": "user", "content": "hi"}


class ToolsByName(Echo):
    tools = ["calculator"]
