"""Fuzz cases for `posttrain sft` and the CLI boundary every command shares (tests/edges.py: each case works or
stops with one clear line). The boundary's own contract (--debug, Ctrl-C, unknown exceptions) is tested below the
cases: those runs end neither as works nor as a clear error by design."""

import json

import pytest
import yaml

from edges import ERROR, WORKS, Case, classify, ids, jsonl_file, run_cli, write_file

pytestmark = pytest.mark.usefixtures("no_activation_probe")  # tests/conftest.py

BASE = ["sft", "model=tiny-random", "data={sft}", "output_dir={tmp}/out", "max_steps=1"]  # the defaults, once
# the works-cases' cost: one step of one row, short rows, no forgetting probe, no generations
TINY = ["forgetting_probe=false", "sample_every=0", "batch_size=1", "micro_batch_size=1", "max_length=64",
        "pad_to_multiple_of=8"]


def _final_exists(run):
    assert (run.tmp / "out" / "final" / "config.json").is_file()


def _summary(**want):
    def check(run):
        summary = run.json("out/summary.json")
        for k, v in want.items():
            assert summary[k] == v, (k, summary[k], v)
        _final_exists(run)
    return check


def _config(**want):
    """config.yaml of the run holds these values (dotted keys), exactly as given."""
    def check(run):
        saved = yaml.safe_load((run.tmp / "out" / "config.yaml").read_text())
        for key, v in want.items():
            node = saved
            for part in key.split("__"):
                node = node[part]
            assert node == v and type(node) is type(v), (key, node, v)
    return check




def _conv(*turns, roles=("user", "assistant")):
    return {"messages": [{"role": roles[i % 2], "content": t} for i, t in enumerate(turns)]}


def _parquet(name, rows):
    def setup(tmp):
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(rows), tmp / name)
    return setup


def _datasets_folder(name, rows):
    def setup(tmp):
        import datasets

        datasets.Dataset.from_list(rows).save_to_disk(str(tmp / name))
    return setup


def _trained_on(*texts):
    """The run's one training sample holds these texts in its loss tokens (the assistant turns, nothing else)."""
    def check(run):
        from posttrain.data import formats
        from posttrain.data.templates import render_row
        from posttrain.models.loading import load_tokenizer

        tok = load_tokenizer("tiny-random")
        rows, fmt = formats.load(run.tmp / "d.jsonl")
        sample = render_row(tok, rows[0].data, fmt)
        trained = [tok.decode(sample.input_ids[a:b]) for a, b in sample.spans]
        assert [t.split("<|im_end|>")[0].strip() for t in trained] == list(texts), trained
        _final_exists(run)
    return check


def _sft(data, *extra):
    return ["sft", "model=tiny-random", f"data={data}", "output_dir={tmp}/out", "max_steps=1", *TINY, *extra]


def _read(data, *extra):
    """A run that reads, checks and tokenizes `data`, loads the model and writes final/, without a step: what a
    data-format case needs (summary.json's train_samples counts what was read)."""
    return _sft(data, "max_steps=0", *extra)


ROWS8 = [_conv(f"What is {i} + 1?", f"{i + 1}.") for i in range(8)]

CASES = [
    Case("sft-works", BASE, WORKS, check=_final_exists),
    Case("sft-negative-lr", [*BASE, "optim.lr=-1"], ERROR, mentions=("optim.lr",)),
    Case("sft-unknown-key", [*BASE, "learning_rate=1e-4"], ERROR, mentions=("learning_rate",)),
    Case("sft-missing-data", ["sft", "model=tiny-random", "data={tmp}/nope.jsonl", "output_dir={tmp}/out"], ERROR,
         mentions=("nope.jsonl",)),
    Case("sft-empty-data", ["sft", "model=tiny-random", "data={empty}", "output_dir={tmp}/out"], ERROR,
         mentions=("empty.jsonl",)),
    Case("sft-resume-keeps-final", [*BASE[:3], "output_dir={copy:sft}", "max_steps=2", "resume=true"], WORKS,
         keep=("{copy:sft}/final",)),
    # ------------------------------------------------------------------ sizes at the edges
    # 1 row: no eval split possible; finishes with final/ and says why there is no eval (was: exit 1, TypeError)
    Case("sft-one-row", _sft("{tmp}/d.jsonl"), WORKS, setup=jsonl_file("d.jsonl", ROWS8[:1]),
         check=_summary(eval_samples=0, train_samples=1)),
    Case("sft-eval-fraction-zero", _read("{sft}", "eval_fraction=0"), WORKS, check=_summary(eval_samples=0)),
    Case("sft-max-steps-0", _sft("{sft}", "max_steps=0"), WORKS, check=_summary(steps=0)),
    Case("sft-batch-larger-than-data", _sft("{sft}", "batch_size=64", "micro_batch_size=64"), WORKS,
         check=_final_exists),
    Case("sft-intervals-above-max-steps", _sft("{sft}", "save_every=500", "eval_every=500", "sample_every=500"),
         WORKS, check=_final_exists),
    Case("sft-max-length-tiny", [*BASE, "max_length=8"], ERROR, mentions=("max_length", "too_long")),
    Case("sft-max-length-tiny-drop-all", [*BASE, "max_length=8", "too_long=drop"], ERROR,
         mentions=("sft.jsonl", "max_length", "dropped")),
    Case("sft-max-length-below-minimum", [*BASE, "max_length=2"], ERROR, mentions=("max_length",)),
    Case("sft-batch-zero", [*BASE, "batch_size=0"], ERROR, mentions=("batch_size",)),
    Case("sft-epochs-and-steps-disagree", [*BASE, "epochs=50"], ERROR, mentions=("epochs", "max_steps")),
    Case("sft-epochs-zero", [*BASE[:-1], "epochs=0"], ERROR, mentions=("epochs",)),
    # ------------------------------------------------------------------ data oddities
    # an assistant turn first (a greeting): trained like any assistant turn (was: a raw transformers ValueError)
    Case("sft-assistant-first", _sft("{tmp}/d.jsonl"), WORKS,
         setup=jsonl_file("d.jsonl", [_conv("Hello! Ask me a sum.", "2 + 2?", "4.", roles=("assistant", "user"))]),
         check=_trained_on("Hello! Ask me a sum.", "4.")),
    Case("sft-system-first", _sft("{tmp}/d.jsonl"), WORKS,
         setup=jsonl_file("d.jsonl", [{"messages": [{"role": "system", "content": "Be brief."},
                                                {"role": "user", "content": "2 + 2?"},
                                                {"role": "assistant", "content": "4."}]}]),
         check=_trained_on("4.")),
    Case("sft-no-assistant-turn", _sft("{tmp}/d.jsonl"), ERROR, setup=jsonl_file("d.jsonl", [_conv("hi")]),
         mentions=("d.jsonl:1", "messages", "assistant")),
    Case("sft-unknown-role", _sft("{tmp}/d.jsonl"), ERROR,
         setup=jsonl_file("d.jsonl", [_conv("hi", "hello", roles=("human", "assistant"))]),
         mentions=("d.jsonl:1", "role", "human")),
    Case("sft-empty-assistant", _sft("{tmp}/d.jsonl"), ERROR, setup=jsonl_file("d.jsonl", [_conv("hi", "  ")]),
         mentions=("d.jsonl:1", "content")),
    Case("sft-content-not-string", _sft("{tmp}/d.jsonl"), ERROR,
         setup=jsonl_file("d.jsonl", [*ROWS8[:2], {"messages": [{"role": "user", "content": 3},
                                                            {"role": "assistant", "content": "x"}]}]),
         mentions=("d.jsonl:3", "content")),
    Case("sft-missing-column", _sft("{tmp}/d.jsonl"), ERROR, setup=jsonl_file("d.jsonl", [*ROWS8[:2], {"text2": "x"}]),
         mentions=("d.jsonl:3", "messages")),
    Case("sft-extra-columns", _read("{tmp}/d.jsonl"), WORKS,
         setup=jsonl_file("d.jsonl", [{**r, "id": i, "meta": {"src": "x"}} for i, r in enumerate(ROWS8)]),
         check=_summary(train_samples=8)),
    Case("sft-unicode", _read("{tmp}/d.jsonl"), WORKS,
         setup=jsonl_file("d.jsonl", [_conv("Wie viel ist 2 + 2? 🤔 — «réponds»", "四 (4) ✓ ∑"), *ROWS8[:3]]),
         check=_summary(train_samples=4)),
    Case("sft-long-line-refused", _sft("{tmp}/d.jsonl", "max_length=64"), ERROR,
         setup=jsonl_file("d.jsonl", [_conv("word " * 2000, "ok")]), mentions=("d.jsonl:1", "max_length", "too_long")),
    Case("sft-long-line-dropped", _read("{tmp}/d.jsonl", "max_length=64", "too_long=drop"), WORKS,
         setup=jsonl_file("d.jsonl", [_conv("word " * 2000, "ok"), *ROWS8[:2]]), check=_summary(train_samples=2)),
    Case("sft-prompt-completion", _read("{tmp}/d.jsonl"), WORKS,
         setup=jsonl_file("d.jsonl", [{"prompt": f"{i} + 1 =", "completion": f" {i + 1}"} for i in range(4)]),
         check=_summary(train_samples=4)),
    Case("sft-text", _read("{tmp}/d.jsonl"), WORKS,
         setup=jsonl_file("d.jsonl", [{"text": f"{i} plus one is {i + 1}."} for i in range(4)]), check=_summary(train_samples=4)),
    Case("sft-empty-text", _sft("{tmp}/d.jsonl"), ERROR, setup=jsonl_file("d.jsonl", [{"text": "a"}, {"text": ""}]),
         mentions=("d.jsonl:2", "text")),
    Case("sft-preference-data", _sft("{pref}"), ERROR, mentions=("pref.jsonl", "messages")),
    Case("sft-json-array", _read("{tmp}/d.json"), WORKS, setup=write_file("d.json", json.dumps(ROWS8[:4])),
         check=_summary(train_samples=4)),
    Case("sft-json-object-not-list", _sft("{tmp}/d.json"), ERROR, setup=write_file("d.json", json.dumps(ROWS8[0])),
         mentions=("d.json",)),
    Case("sft-jsonl-not-objects", _sft("{tmp}/d.jsonl"), ERROR, setup=write_file("d.jsonl", "[1, 2]\n"),
         mentions=("d.jsonl:1", "object")),
    Case("sft-invalid-json-line", _sft("{tmp}/d.jsonl"), ERROR,
         setup=write_file("d.jsonl", json.dumps(ROWS8[0]) + "\n{not json\n"), mentions=("d.jsonl:2", "json")),
    Case("sft-blank-lines", _read("{tmp}/d.jsonl"), WORKS,
         setup=write_file("d.jsonl", "\n".join(json.dumps(r) for r in ROWS8[:3]) + "\n\n\n"), check=_summary(train_samples=3)),
    Case("sft-parquet", _read("{tmp}/d.parquet"), WORKS,
         setup=_parquet("d.parquet", [{"prompt": f"{i} + 1 =", "completion": f" {i + 1}"} for i in range(4)]),
         check=_summary(train_samples=4)),
    Case("sft-datasets-folder", _read("{tmp}/ds"), WORKS,
         setup=_datasets_folder("ds", [{"text": f"{i} plus one is {i + 1}."} for i in range(4)]),
         check=_summary(train_samples=4)),
    Case("sft-plain-folder", _sft("{tmp}"), ERROR, mentions=("datasets folder",)),
    Case("sft-csv", _sft("{tmp}/d.csv"), ERROR, setup=write_file("d.csv", "a,b\n1,2\n"), mentions=("d.csv", ".jsonl")),
    Case("sft-task", _read("arithmetic:16"), WORKS, check=_summary(train_samples=16)),
    Case("sft-task-bad-count", _sft("arithmetic:abc"), ERROR, mentions=("arithmetic:abc",)),
    Case("sft-eval-data-missing", [*BASE, "eval_data={tmp}/nope.jsonl"], ERROR, mentions=("nope.jsonl",)),
    Case("sft-eval-data-empty", [*BASE, "eval_data={empty}"], ERROR, mentions=("empty.jsonl",)),
    # ------------------------------------------------------------------ values YAML would misread; option checks
    # a str key keeps its text: output_dir=2024 is a folder named 2024, a colon stays in a template path
    Case("sft-output-dir-number", ["sft", "model=tiny-random", "data={sft}", "output_dir=2024", "max_steps=0", *TINY],
         WORKS, check=lambda run: (run.tmp / "2024" / "final").is_dir()),
    Case("sft-str-key-colon", [*BASE, "chat_template=Be brief: x"], ERROR, mentions=("chat_template", "Be brief: x")),
    Case("sft-yaml-number-for-text", ["sft", "--config", "{tmp}/c.yaml", "max_steps=0", *TINY], ERROR,
         setup=write_file("c.yaml", "output_dir: 2024\n"), mentions=("output_dir", "quote")),
    Case("sft-yaml-non-string-key", ["sft", "--config", "{tmp}/c.yaml"], ERROR, setup=write_file("c.yaml", "1: 2\n"),
         mentions=("c.yaml", "key 1")),
    Case("sft-yaml-nested-non-string-key", ["sft", "--config", "{tmp}/c.yaml"], ERROR,
         setup=write_file("c.yaml", "optim:\n  true: 3\n"), mentions=("c.yaml", "optim")),
    Case("sft-yaml-not-mapping", ["sft", "--config", "{tmp}/c.yaml"], ERROR, setup=write_file("c.yaml", "- a\n- b\n"),
         mentions=("c.yaml", "mapping")),
    Case("sft-yaml-invalid", ["sft", "--config", "{tmp}/c.yaml"], ERROR, setup=write_file("c.yaml", "a: [1,\n"),
         mentions=("c.yaml", "yaml")),
    Case("sft-config-missing", ["sft", "--config", "{tmp}/none.yaml"], ERROR, mentions=("none.yaml",)),
    Case("sft-own-config", ["sft", "--config", "{run:sft}/config.yaml", "output_dir={tmp}/out", "max_steps=1", *TINY],
         WORKS, check=_final_exists),
    Case("sft-lr-inf", [*BASE, "optim.lr=.inf"], ERROR, mentions=("optim.lr", "finite")),
    Case("sft-lr-nan", [*BASE, "optim.lr=nan"], ERROR, mentions=("optim.lr", "finite")),
    Case("sft-lr-zero", [*BASE, "lr=0"], ERROR, mentions=("optim.lr",)),
    Case("sft-betas-out-of-range", [*BASE, "optim.betas=[1.5, 2]"], ERROR, mentions=("optim.betas", "[0, 1)")),
    Case("sft-betas-one-value", [*BASE, "optim.betas=[0.9]"], ERROR, mentions=("optim.betas",)),
    Case("sft-unknown-schedule", [*BASE, "optim.schedule=cosin"], ERROR, mentions=("optim.schedule",)),
    Case("sft-unknown-dtype", [*BASE, "dtype=float8"], ERROR, mentions=("float8",)),
    Case("sft-unknown-device", [*BASE, "device=tpu"], ERROR, mentions=("device",)),
    Case("sft-bool-word", [*BASE, "packing=maybe"], ERROR, mentions=("packing",)),
    Case("sft-lora-unknown-target", [*BASE, "lora.enabled=true", "lora.target_modules=q_proj,qkv"], ERROR,
         mentions=("lora.target_modules", "qkv", "q_proj")),
    Case("sft-lora-target-list", _sft("{sft}", "lora.enabled=true", "lora.r=2", "lora.target_modules=[q_proj, v_proj]"),
         WORKS, check=_config(lora__target_modules="q_proj,v_proj")),
    Case("sft-lora-modules-to-save-unknown", [*BASE, "lora.enabled=true", "lora.modules_to_save=[foo]"], ERROR,
         mentions=("lora.modules_to_save", "foo")),
    Case("sft-lora-modules-to-save", _sft("{sft}", "lora.enabled=true", "lora.r=2", "lora.modules_to_save=[lm_head]"),
         WORKS, check=_final_exists),
    Case("sft-unknown-chat-template", [*BASE, "chat_template=chatmll"], ERROR, mentions=("chat_template", "chatml")),
    Case("sft-model-typo-folder", ["sft", "model={tmp}/models/nope", "data={sft}", "output_dir={tmp}/out"], ERROR,
         mentions=("nope",)),
    Case("sft-model-folder-without-config", ["sft", "model={tmp}", "data={sft}", "output_dir={tmp}/out"], ERROR,
         mentions=("config.json",)),
    Case("sft-positional-word", [*BASE, "fast"], ERROR, mentions=("fast",)),
    Case("sft-dashed-needs-value", [*BASE, "--max-length"], ERROR, mentions=("--max_length",)),
    Case("sft-dashed-forms", ["sft", "--model", "tiny-random", "--data={sft}", "--output-dir", "{tmp}/out",
                              "--max-steps", "1", "--no-forgetting-probe", "--sample-every=0", "--batch-size", "1",
                              "--micro-batch-size=1", "--max-length", "64", "--packing", "false"], WORKS,
         check=_config(max_steps=1, forgetting_probe=False, sample_every=0, max_length=64, packing=False)),
    Case("unknown-command", ["sftt"], ERROR, mentions=("sftt", "sft")),
]


@pytest.mark.parametrize("case", CASES, ids=ids(CASES))
def test_case(case, workspace, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # relative output_dir= values land in the case's folder
    classify(case, workspace, tmp_path)


# ---------------------------------------------------------------------------------------------------------------
# The CLI boundary: --debug / POSTTRAIN_DEBUG, Ctrl-C, exceptions that are bugs.


@pytest.mark.parametrize("how", [["--debug"], []])
def test_debug_shows_the_traceback_of_a_user_error(tmp_path, how):
    env = {} if how else {"POSTTRAIN_DEBUG": "1"}
    rc, _, err = run_cli(["sft", "model=tiny-random", f"data={tmp_path}/nope.jsonl", *how], env)
    assert rc == 2 and "Traceback" in err and err.strip().splitlines()[-1].startswith("error: data")
    rc, _, err = run_cli(["sft", "model=tiny-random", f"data={tmp_path}/nope.jsonl"], {"POSTTRAIN_DEBUG": "0"})
    assert rc == 2 and "Traceback" not in err and len(err.strip().splitlines()) == 1


def _interrupt_at(monkeypatch, step_to_fail: int):
    from posttrain.recipes import sft

    real = sft.sft_step

    def step(run, step):
        if step == step_to_fail:
            raise KeyboardInterrupt
        return real(run, step)

    monkeypatch.setattr(sft, "sft_step", step)


def test_ctrl_c_names_the_checkpoints_kept_and_how_to_resume(workspace, tmp_path, monkeypatch):
    _interrupt_at(monkeypatch, 2)  # after steps 1 and 2 were checkpointed
    out = tmp_path / "run"
    argv = ["sft", "model=tiny-random", f"data={workspace.file('sft')}", f"output_dir={out}", "max_steps=4",
            "save_every=1", "keep_checkpoints=4", *TINY]
    rc, _, err = run_cli(argv)
    lines = err.strip().splitlines()
    assert rc == 130 and "Traceback" not in err, err
    assert lines[-1] == (f"interrupted: the checkpoints in {out}/checkpoints are intact (newest: step-2); continue "
                         "with the same command and resume=true"), err
    monkeypatch.undo()
    rc, _, err = run_cli([*argv, "resume=true"])
    assert rc == 0, err
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    assert steps == [1, 2, 3, 4]


def test_ctrl_c_before_any_checkpoint(workspace, tmp_path, monkeypatch):
    _interrupt_at(monkeypatch, 0)
    out = tmp_path / "run"
    rc, _, err = run_cli(["sft", "model=tiny-random", f"data={workspace.file('sft')}", f"output_dir={out}",
                          "max_steps=2", *TINY])
    assert rc == 130 and err.strip().splitlines()[-1] == (
        f"interrupted: no checkpoint was saved in {out} yet (save_every sets how often); run the same command "
        "again to start over"), err


def test_an_unknown_exception_keeps_its_traceback(monkeypatch):
    from posttrain.plan import methods_cli

    def broken(argv):
        raise RuntimeError("a bug")

    monkeypatch.setattr(methods_cli, "main", broken)
    with pytest.raises(RuntimeError, match="a bug"):
        run_cli(["methods"])
