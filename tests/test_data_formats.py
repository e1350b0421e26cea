import json

import pytest

from conftest import conv, write_jsonl
from posttrain.cli import main as cli
from posttrain.data import formats
from posttrain.errors import DataError


def test_detects_every_format(tmp_path):
    cases = {
        "conversation": conv("hi", "hello"),
        "text": {"text": "plain"},
        "prompt_completion": {"prompt": "a", "completion": "b"},
        "prompt_only": {"prompt": "a", "answer": "3"},
        "preference": {"prompt": "a", "chosen": "b", "rejected": "c"},
        "implicit_preference": {"chosen": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "b"}],
                                "rejected": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "c"}]},
        "unpaired_preference": {"prompt": "a", "completion": "b", "label": True},
    }
    for fmt, row in cases.items():
        rows, got = formats.load(write_jsonl(tmp_path / f"{fmt}.jsonl", [row, row]))
        assert got == fmt
        assert rows[1].number == 2


def test_parquet_and_datasets_folder(tmp_path):
    import datasets

    data = [conv("q1", "a1"), conv("q2", "a2")]
    ds = datasets.Dataset.from_list(data)
    ds.to_parquet(str(tmp_path / "d.parquet"))
    ds.save_to_disk(str(tmp_path / "folder"))
    for src in (tmp_path / "d.parquet", tmp_path / "folder"):
        rows, fmt = formats.load(src)
        assert fmt == "conversation" and rows[1].data["messages"][1]["content"] == "a2"


def test_extra_columns_are_kept(tmp_path):
    rows, _ = formats.load(write_jsonl(tmp_path / "d.jsonl", [{"prompt": "q", "answer": "4", "tests": ["x"]}]))
    assert rows[0].data["answer"] == "4" and rows[0].data["tests"] == ["x"]


GOOD = json.dumps(conv("hello", "hi there"))
MALFORMED = [
    ("missing key", [GOOD, json.dumps({"messages": [{"role": "user"}]})], 2, "messages[0]", "missing key 'content'"),
    ("unknown role", [GOOD, GOOD, json.dumps({"messages": [{"role": "robot", "content": "x"}]})], 3, "messages[0].role", "unknown role 'robot'"),
    ("empty assistant", [json.dumps(conv("q", "   "))], 1, "messages[1].content", "empty assistant turn"),
    ("non-string content", [GOOD, json.dumps({"messages": [{"role": "user", "content": 5}]})], 2, "messages[0].content", "must be a string"),
    ("invalid json", [GOOD, GOOD, GOOD, '{"messages": [oops'], 4, None, "invalid JSON"),
    ("missing field of format", [GOOD, json.dumps({"text": "x"})], 2, "messages", "missing key"),
]


@pytest.mark.parametrize("name,lines,row,field,problem", MALFORMED, ids=[m[0] for m in MALFORMED])
def test_malformed_rows_are_named(tmp_path, name, lines, row, field, problem):
    path = write_jsonl(tmp_path / "bad.jsonl", lines)
    with pytest.raises(DataError) as e:
        formats.load(path)
    assert e.value.row == row and e.value.field == field and problem in e.value.problem
    assert str(e.value).startswith(f"{path}:{row}: ")


def test_sft_refuses_bad_data_before_training(tmp_path, capsys):
    path = write_jsonl(tmp_path / "bad.jsonl", [GOOD, json.dumps(conv("q", 7))])
    out = tmp_path / "run"
    assert cli(["sft", "model=tiny-random", f"data={path}", f"output_dir={out}", "max_steps=2"]) == 2
    err = capsys.readouterr().err
    assert f"{path}:2: messages[1].content: content must be a string" in err
    assert not (out / "metrics.jsonl").exists() and not (out / "checkpoints").exists()


def test_sft_refuses_too_long_sample_naming_row(tmp_path, capsys):
    path = write_jsonl(tmp_path / "long.jsonl", [GOOD, json.dumps(conv("q", "word " * 300))])
    out = tmp_path / "run"
    assert cli(["sft", "model=tiny-random", f"data={path}", f"output_dir={out}", "max_length=64", "eval_fraction=0"]) == 2
    err = capsys.readouterr().err
    assert f"{path}:2: " in err and "> max_length=64" in err
