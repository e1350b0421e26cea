"""Tool-use demonstrations for an SFT warm-up, rendered in the same tool format the rollout uses.

    rows = demonstrations(tok, "multiply_3x2:300", seed=1)     # [{"messages": [...]}, ...]
    write_jsonl("demos.jsonl", rows); posttrain sft data=demos.jsonl ...

A calculator demonstration is: the environment's opening (with the tool instructions of the tag
format, or the template's tools), the call `<tool>calculator: A * B</tool>`, the tool's output as the
format's observation message, and the answer `A * B = P. The answer is P.` SFT trains the two
assistant turns (the call and the answer); the observation is never trained.
"""

from __future__ import annotations

import json

from posttrain.agentic.calculator import evaluate, format_value
from posttrain.agentic.envs import CalculatorEnv
from posttrain.agentic.formats import TemplateFormat, make_format
from posttrain.data import tasks
from posttrain.errors import UserError


def calculator_demo(fmt, env: CalculatorEnv, row: dict) -> dict:
    messages = fmt.prompt_messages(env.reset(row, 0))
    expression = f"{row['a']} * {row['b']}" if "a" in row and "b" in row else row["expression"]
    result = format_value(evaluate(expression))
    if result != str(row["answer"]):
        raise ValueError(f"demonstration of {expression}: the calculator says {result}, the row says {row['answer']}")
    return {"messages": messages + [
        {"role": "assistant", "content": fmt.render_call("calculator", {"expression": expression})},
        fmt.observation_message(result),
        {"role": "assistant", "content": f"{expression} = {result}. The answer is {result}."},
    ]}


def demonstrations(tok, data: str = "multiply_3x2:300", seed: int = 1, tool_format: str = "auto") -> list[dict]:
    """Calculator demonstrations for the rows of a task (rows need `answer` and `a`, `b` or `expression`)."""
    env = CalculatorEnv()
    fmt = make_format(tok, env.tools, tool_format)
    if isinstance(fmt, TemplateFormat):
        raise UserError("demonstrations are rendered with the tag format (the SFT recipe renders conversations "
                        "without tools=); pass tool_format=tag and train/evaluate with agent.tool_format=tag")
    env.bind(fmt)
    return [calculator_demo(fmt, env, row) for row in tasks.generate(data, seed=seed)]


def main(argv: list[str]) -> int:
    """python -m posttrain.agentic.demos MODEL DATA OUT.jsonl [SEED]"""
    from posttrain.models.loading import load_tokenizer  # torch: not imported with this module

    if len(argv) < 3:
        raise UserError("usage: python -m posttrain.agentic.demos MODEL multiply_3x2:300 demos.jsonl [seed]")
    rows = demonstrations(load_tokenizer(argv[0]), argv[1], int(argv[3]) if len(argv) > 3 else 1, "tag")
    with open(argv[2], "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    print(f"{len(rows)} demonstrations -> {argv[2]}")
    return 0


if __name__ == "__main__":
    import sys

    raise SystemExit(main(sys.argv[1:]))
