"""Fuzz cases for data formats through the commands that read data, and `posttrain data export` (tests/edges.py).

Every reader goes through posttrain.data.formats.read_rows, so an oddity of the file (encoding, JSON shape, a
folder, parquet) is tried once per command family that reads it: data export, eval, generate, score, sft, rl,
dpo, eval contamination, label.
"""

import json

import pytest

from edges import ERROR, WORKS, Case, classify, ids

pytestmark = pytest.mark.usefixtures("no_activation_probe")  # tests/conftest.py

LATIN1 = b'{"prompt": "What is 1 + 1?", "answer": "2"}\n{"prompt": "caf\xe9 + 1?", "answer": "2"}\n'
SURROGATE = b'{"prompt": "What is 1 + 1?", "answer": "2"}\n{"prompt": "x \\ud800 y", "answer": "2"}\n'
PAIR = b'{"prompt": "Say \\ud83d\\ude00", "answer": "2"}\n'  # a surrogate pair: an emoji, valid
BOM = b'\xef\xbb\xbf{"prompt": "What is 1 + 1?", "answer": "2"}\n'


def _bytes(name, data: bytes):
    def setup(tmp):
        (tmp / name).write_bytes(data)
    return setup


def _rows(name, rows):
    def setup(tmp):
        (tmp / name).write_text("".join((r if isinstance(r, str) else json.dumps(r, ensure_ascii=False)) + "\n" for r in rows))
    return setup


def _parquet(name, rows):
    def setup(tmp):
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(rows), tmp / name)
    return setup


def _folder_with_file(tmp):
    (tmp / "d").mkdir()
    (tmp / "d" / "train.jsonl").write_text(json.dumps({"prompt": "x", "answer": "1"}) + "\n")


def _datasets_folder(tmp):
    import datasets

    datasets.Dataset.from_list([{"prompt": f"What is {i} + 1?", "answer": str(i + 1)} for i in range(3)]).save_to_disk(tmp / "ds")


def _exported(n, *words):
    def check(run):
        lines = (run.tmp / "x.jsonl").read_text().splitlines()
        assert len(lines) == n, len(lines)
        for w in words:
            assert w in lines[0] or w in run.out, (w, lines[0], run.out)
    return check


EXPORT = ["data", "export", "output={tmp}/x.jsonl"]
EVAL = ["eval", "model=tiny-random", "reward=math", "output_dir={tmp}/e", "n=1", "max_new_tokens=2"]
GEN = ["generate", "model=tiny-random", "output={tmp}/s.jsonl", "max_new_tokens=2"]
SCORE = ["score", "reward=math", "output={tmp}/o.jsonl"]
SFT = ["sft", "model=tiny-random", "output_dir={tmp}/out", "max_steps=1"]
RL = ["rl", "model=tiny-random", "reward=math", "output_dir={tmp}/out", "max_steps=1", "prompts_per_step=2", "group_size=2",
      "max_new_tokens=2"]
DPO = ["dpo", "model=tiny-random", "output_dir={tmp}/out", "max_steps=1"]
CONTAM = ["eval", "contamination", "eval={prompts}"]
LABEL = ["label", "judge.base_url=http://127.0.0.1:9/v1", "samples_a={completions}", "output={tmp}/p.jsonl"]

CASES = [
    # ---- encodings: one DataError naming file:row and the byte offset, in every reader
    Case("export-latin1", [*EXPORT, "data={tmp}/l1.jsonl"], ERROR, ("l1.jsonl:2", "utf-8", "byte 0xe9 at byte offset 59"),
         setup=_bytes("l1.jsonl", LATIN1)),
    Case("eval-latin1", [*EVAL, "data={tmp}/l1.jsonl"], ERROR, ("l1.jsonl:2", "utf-8"), setup=_bytes("l1.jsonl", LATIN1)),
    Case("generate-latin1", [*GEN, "data={tmp}/l1.jsonl"], ERROR, ("l1.jsonl:2", "utf-8"), setup=_bytes("l1.jsonl", LATIN1)),
    Case("score-latin1", [*SCORE, "data={tmp}/l1.jsonl"], ERROR, ("l1.jsonl:2", "utf-8"), setup=_bytes("l1.jsonl", LATIN1)),
    Case("sft-latin1", [*SFT, "data={tmp}/l1.jsonl"], ERROR, ("l1.jsonl:2", "utf-8"), setup=_bytes("l1.jsonl", LATIN1)),
    Case("rl-latin1", [*RL, "data={tmp}/l1.jsonl"], ERROR, ("l1.jsonl:2", "utf-8"), setup=_bytes("l1.jsonl", LATIN1)),
    Case("contamination-latin1-train", [*CONTAM, "train={tmp}/l1.jsonl"], ERROR, ("l1.jsonl:2", "utf-8"),
         setup=_bytes("l1.jsonl", LATIN1)),
    Case("label-latin1", [*LABEL, "data={tmp}/l1.jsonl"], ERROR, ("l1.jsonl:2", "utf-8"), setup=_bytes("l1.jsonl", LATIN1)),
    Case("export-latin1-json", [*EXPORT, "data={tmp}/l1.json"], ERROR, ("l1.json", "utf-8", "line 2"),
         setup=_bytes("l1.json", b"[" + LATIN1.replace(b"}\n{", b"},\n{") + b"]")),
    Case("export-lone-surrogate", [*EXPORT, "data={tmp}/s.jsonl"], ERROR, ("s.jsonl:2", "prompt", "surrogate", "\\ud800"),
         setup=_bytes("s.jsonl", SURROGATE)),
    Case("eval-lone-surrogate", [*EVAL, "data={tmp}/s.jsonl"], ERROR, ("s.jsonl:2", "prompt", "surrogate"),
         setup=_bytes("s.jsonl", SURROGATE)),
    Case("generate-lone-surrogate", [*GEN, "data={tmp}/sg.jsonl"], ERROR, ("sg.jsonl:2", "prompt", "surrogate"),
         setup=_bytes("sg.jsonl", SURROGATE)),
    Case("score-lone-surrogate", [*SCORE, "data={tmp}/s.jsonl"], ERROR, ("s.jsonl:2", "surrogate"),
         setup=_bytes("s.jsonl", SURROGATE)),
    Case("sft-lone-surrogate-in-messages", [*SFT, "data={tmp}/s.jsonl"], ERROR, ("s.jsonl:1", "messages[1].content", "surrogate"),
         setup=_bytes("s.jsonl", b'{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "\\udc00"}]}\n')),
    Case("export-surrogate-pair-works", [*EXPORT, "data={tmp}/p.jsonl"], WORKS, check=_exported(1, "\U0001F600"),
         setup=_bytes("p.jsonl", PAIR)),
    Case("export-utf8-bom-works", [*EXPORT, "data={tmp}/b.jsonl"], WORKS, check=_exported(1, "What is 1 + 1?"),
         setup=_bytes("b.jsonl", BOM)),
    # ---- built-in task specs
    Case("export-arithmetic-all", [*EXPORT, "data=arithmetic:all"], ERROR, ("arithmetic:all", "arithmetic:200")),
    Case("export-arithmetic-abc", [*EXPORT, "data=arithmetic:abc"], ERROR, ("arithmetic:abc", "'abc'", "arithmetic:200")),
    Case("eval-arithmetic-abc", [*EVAL, "data=arithmetic:abc"], ERROR, ("arithmetic:abc", "arithmetic:200")),
    Case("rl-arithmetic-all", [*RL, "data=arithmetic:all"], ERROR, ("arithmetic:all", "row count")),
    Case("export-task-negative-count", [*EXPORT, "data=single_digit_add:-3"], ERROR, ("single_digit_add:-3", "single_digit_add:all")),
    Case("export-single-digit-all-works", [*EXPORT, "data=single_digit_add:all"], WORKS, check=_exported(81, "What is 1 + 1?")),
    Case("export-task-in-mixture-bad-count", [*EXPORT, "data=arithmetic:x:0.5,single_digit_add:all:0.5"], ERROR,
         ("arithmetic:x",)),
    # ---- JSON shapes and file kinds
    Case("export-json-array-works", [*EXPORT, "data={tmp}/a.json"], WORKS, check=_exported(2, "prompt"),
         setup=_bytes("a.json", b'[{"prompt": "a", "answer": "1"}, {"prompt": "b", "answer": "2"}]')),
    Case("export-jsonl-named-json", [*EXPORT, "data={tmp}/a.json"], ERROR, ("a.json", ".jsonl"),
         setup=_bytes("a.json", b'{"prompt": "a"}\n{"prompt": "b"}\n')),
    Case("export-json-object-not-list", [*EXPORT, "data={tmp}/a.json"], ERROR, ("a.json", "list"),
         setup=_bytes("a.json", b'{"prompt": "a"}')),
    Case("export-json-list-of-numbers", [*EXPORT, "data={tmp}/a.json"], ERROR, ("a.json:2", "object"),
         setup=_bytes("a.json", b'[{"prompt": "a"}, 3]')),
    Case("export-jsonl-array-line", [*EXPORT, "data={tmp}/a.jsonl"], ERROR, ("a.jsonl:1", "object", "list"),
         setup=_bytes("a.jsonl", b'[{"prompt": "a"}]\n')),
    Case("export-jsonl-truncated-line", [*EXPORT, "data={tmp}/a.jsonl"], ERROR, ("a.jsonl:2", "invalid json"),
         setup=_bytes("a.jsonl", b'{"prompt": "a"}\n{"prompt": "b\n')),
    Case("export-blank-lines-skipped", [*EXPORT, "data={tmp}/a.jsonl"], WORKS, check=_exported(2),
         setup=_bytes("a.jsonl", b'\n{"prompt": "a"}\n\n   \n{"prompt": "b"}\n\n')),
    Case("export-parquet-works", [*EXPORT, "data={tmp}/a.parquet"], WORKS, check=_exported(2, "answer"),
         setup=_parquet("a.parquet", [{"prompt": "What is 1 + 1?", "answer": "2"}, {"prompt": "What is 2 + 2?", "answer": "4"}])),
    Case("eval-parquet-works", [*EVAL, "data={tmp}/a.parquet"], WORKS,
         setup=_parquet("a.parquet", [{"prompt": "What is 1 + 1?", "answer": "2"}])),
    Case("export-csv-unsupported", [*EXPORT, "data={tmp}/a.csv"], ERROR, ("a.csv", ".jsonl"), setup=_bytes("a.csv", b"prompt\nx\n")),
    Case("export-folder-not-datasets", [*EXPORT, "data={tmp}/d"], ERROR, ("not a datasets folder", "train.jsonl"),
         setup=_folder_with_file),
    Case("export-datasets-folder-works", [*EXPORT, "data={tmp}/ds"], WORKS, check=_exported(3, "What is 0 + 1?"),
         setup=_datasets_folder),
    Case("export-missing-file", [*EXPORT, "data={tmp}/nope.jsonl"], ERROR, ("nope.jsonl", "not found")),
    Case("export-empty-file", [*EXPORT, "data={empty}"], ERROR, ("empty.jsonl",)),
    Case("export-no-output", ["data", "export", "data={prompts}"], ERROR, ("output",)),
    Case("export-unknown-subcommand", ["data", "import", "data={prompts}"], ERROR, ("import", "export")),
    # ---- contents: unicode, long lines, missing / extra columns, wrong types
    Case("generate-emoji-works", [*GEN, "data={tmp}/u.jsonl"], WORKS,
         setup=_rows("u.jsonl", [{"prompt": "Zähle bis 3 👋🏽 世界 \u200d"}, {"prompt": "x"}]),
         check=lambda run: _n_lines(run, "s.jsonl", 2)),
    # a prompt beyond the context: its documented error line (naming the context), the other prompt sampled
    Case("generate-prompt-longer-than-context", [*GEN, "data={tmp}/u.jsonl", "max_model_len=64"], WORKS,
         setup=_rows("u.jsonl", [{"prompt": "word " * 200}, {"prompt": "x"}]),
         check=lambda run: _long_prompt(run)),
    Case("export-unicode-keys-kept", [*EXPORT, "data={tmp}/u.jsonl"], WORKS, check=_exported(1, "ключ"),
         setup=_rows("u.jsonl", [{"prompt": "x", "ключ": "значение"}])),
    Case("eval-prompt-a-number", [*EVAL, "data={tmp}/t.jsonl"], ERROR, ("t.jsonl:1", "prompt"),
         setup=_rows("t.jsonl", [{"prompt": 5, "answer": "5"}])),
    Case("eval-prompt-null", [*EVAL, "data={tmp}/t.jsonl"], ERROR, ("t.jsonl:1", "prompt"),
         setup=_rows("t.jsonl", [{"prompt": None, "answer": "5"}])),
    Case("eval-message-without-role", [*EVAL, "data={tmp}/t.jsonl"], ERROR, ("t.jsonl:1", "role"),
         setup=_rows("t.jsonl", [{"prompt": [{"content": "hi"}], "answer": "5"}])),
    Case("eval-answer-missing-row-2", [*EVAL, "data={tmp}/t.jsonl"], ERROR, ("t.jsonl:2", "answer"),
         setup=_rows("t.jsonl", [{"prompt": "a", "answer": "1"}, {"prompt": "b"}])),
    Case("eval-extra-columns-works", [*EVAL, "data={tmp}/t.jsonl"], WORKS,
         setup=_rows("t.jsonl", [{"prompt": "a", "answer": "1", "meta": {"x": [1, 2]}, "level": 3}])),
    Case("generate-no-prompt-column", [*GEN, "data={sft}"], ERROR, ("sft.jsonl:1", "prompt")),
    Case("sft-wrong-content-type", [*SFT, "data={tmp}/t.jsonl"], ERROR, ("t.jsonl:1", "messages[1].content", "string"),
         setup=_rows("t.jsonl", [{"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": 7}]}])),
    Case("dpo-chosen-missing-row-2", [*DPO, "data={tmp}/t.jsonl"], ERROR, ("t.jsonl:2", "chosen"),
         setup=_rows("t.jsonl", [{"prompt": "a", "chosen": "x", "rejected": "y"}, {"prompt": "a", "rejected": "y"}])),
    Case("contamination-surrogate-eval", ["eval", "contamination", "train={prompts}", "eval={tmp}/s.jsonl"], ERROR,
         ("s.jsonl:2", "surrogate"), setup=_bytes("s.jsonl", SURROGATE)),
]


def _n_lines(run, rel, n):
    lines = (run.tmp / rel).read_text().splitlines()
    assert len(lines) == n and all("token_ids" in json.loads(x) for x in lines), lines[:1]


def _long_prompt(run):
    lines = [json.loads(x) for x in (run.tmp / "s.jsonl").read_text().splitlines()]
    assert "context holds 64" in lines[0]["error"] and lines[1]["token_ids"], lines
    assert "1 prompts failed" in run.out, run.out


@pytest.mark.parametrize("case", CASES, ids=ids(CASES))
def test_case(case, workspace, tmp_path):
    classify(case, workspace, tmp_path)
