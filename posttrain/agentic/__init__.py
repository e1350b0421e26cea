"""Agentic multi-turn RL: environments, tools, tool-call formats, the multi-turn rollout.

    env.py        the Environment protocol (reset / step / reward), ToolEnv, the registry
    envs.py       the built-in environments; load_env: a registered name or `env=path.py:Class`
    tools.py      Tool, ToolResult, containment (errors and timeouts become observations), built-ins
    calculator.py safe arithmetic by AST evaluation (no eval)
    search.py     a mock search over a local document set
    formats.py    tool calls in the chat template's format (Hermes `<tool_call>`) or a `<tool>` tag
    rollout.py    many episodes in flight on the built-in engine; token ids concatenated turn by turn
    episodes.py   an agent run's set-up (env + tool format, checked per row), agent/* metrics, episodes rendered
    demos.py      tool-use demonstrations for an SFT warm-up

Built on these: `posttrain rl env=...` (posttrain/recipes/rl/agentic.py) and `posttrain eval env=...`
(posttrain/eval/agentic.py: success, pass^k, turns, tool calls, env vs model time).
"""
