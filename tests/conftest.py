import os

import pytest

os.environ.setdefault("POSTTRAIN_NO_PROGRESS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")


@pytest.fixture(scope="session")
def tiny_tok():
    from posttrain.models.loading import load_tokenizer

    return load_tokenizer("tiny-random")


def write_jsonl(path, rows):
    import json

    with open(path, "w") as f:
        for r in rows:
            f.write((r if isinstance(r, str) else json.dumps(r)) + "\n")
    return str(path)


def conv(*turns):
    roles = ["user", "assistant"]
    return {"messages": [{"role": roles[i % 2], "content": t} for i, t in enumerate(turns)]}
