"""`posttrain generate` writes a file that `posttrain score` reads as it is (prompt, completion, the row's columns)."""

import json

from posttrain.cli import main


def test_generate_output_is_scored_by_score(tmp_path):
    samples, scored = tmp_path / "samples.jsonl", tmp_path / "scored.jsonl"
    assert main(["generate", "model=tiny-random", "data=single_digit_add:all", "n=2", "max_new_tokens=4",
                 f"output={samples}"]) == 0
    rows = [json.loads(line) for line in samples.read_text().splitlines()]
    assert len(rows) == 81 * 2
    first = rows[0]
    assert first["answer"] == "2" and first["prompt"][0]["content"].startswith("What is 1 + 1?")
    assert first["completion"] == [{"role": "assistant", "content": first["text"]}]  # the prompt's form (TRL: prompt + completion)
    assert len(first["token_ids"]) == len(first["logprobs"]) <= 4
    assert main(["score", f"data={samples}", "reward=math", f"output={scored}"]) == 0
    out = [json.loads(line) for line in scored.read_text().splitlines()]
    assert len(out) == len(rows) and all(r["reward"] == 0.0 for r in out)  # a random model never answers right
