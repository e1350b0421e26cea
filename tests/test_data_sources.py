"""`data=` beyond local files, and files in the columns TRL reads:
- a Hub dataset `org/name[:config]:split` through `datasets.load_dataset`, from datasets' cache offline, refused at
  once (no retries) when neither cached nor reachable; no network: the cache is built here in the layout
  `load_dataset` writes for a Hub dataset (<cache>/<org>___<name>/<config>/<version>/<hash>/) and read offline;
- a weighted mixture `a.jsonl:0.7,org/name:0.3` (subsampled, exact counts, deterministic by seed);
- round trips: `posttrain generate` -> `posttrain sft`, and a built-in task written to a file -> TRL's columns."""

import glob
import json
import shutil
import time
from pathlib import Path

import pytest

from conftest import write_jsonl
from posttrain.cli import main
from posttrain.data import formats
from posttrain.errors import UserError

REPO = "posttrain-test/tiny-sft"


def sft_rows(n, tag="hub"):
    return [{"prompt": [{"role": "user", "content": f"{tag} question {i}"}],
             "completion": [{"role": "assistant", "content": f"{tag} answer {i}"}]} for i in range(n)]


def cache_hub_dataset(cache: Path, repo: str, splits: dict[str, list[dict]], tmp: Path) -> None:
    """What `load_dataset(repo)` leaves in the cache after a download: Arrow files of each split and
    dataset_info.json under <cache>/<org>___<name>/default/0.0.0/<hash>/ (built from local JSONL files)."""
    from datasets.packaged_modules.json.json import Json

    files = {name: write_jsonl(tmp / f"{name}.jsonl", rows) for name, rows in splits.items()}
    name = repo.split("/")[1]
    Json(cache_dir=str(tmp / "build"), dataset_name=name, config_name="default", data_files=files, hash="0a1b2c").download_and_prepare()
    built = glob.glob(str(tmp / "build" / name / "default-*" / "0.0.0" / "0a1b2c"))[0]
    shutil.copytree(built, cache / f"{repo.replace('/', '___')}" / "default" / "0.0.0" / "0a1b2c")


@pytest.fixture
def hub_cache(tmp_path, monkeypatch):
    """A datasets cache holding REPO (train 6 rows, test 2), HF_DATASETS_CACHE pointing at it, offline."""
    cache = tmp_path / "hf" / "datasets"
    cache_hub_dataset(cache, REPO, {"train": sft_rows(6), "test": sft_rows(2, "test")}, tmp_path)
    monkeypatch.setenv("HF_DATASETS_CACHE", str(cache))
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    return cache


def test_hub_dataset_from_the_cache_offline(hub_cache):
    rows = formats.read_rows(REPO)  # no split: train
    assert [r.data for r in rows] == sft_rows(6) and rows[0].source == REPO and rows[2].number == 3
    assert [r.data for r in formats.read_rows(f"{REPO}:test")] == sft_rows(2, "test")
    assert [r.data for r in formats.read_rows(f"{REPO}:default:train[:2]")] == sft_rows(2)  # config:split, a slice
    with pytest.raises(UserError, match=r"Unknown split \"validation\".*'train', 'test'"):
        formats.read_rows(f"{REPO}:validation")


def test_not_cached_is_refused_at_once_offline_and_without_network(hub_cache, monkeypatch):
    import datasets

    t = time.perf_counter()
    with pytest.raises(UserError, match=r"trl-lib/Capybara' is no local file.*not in the datasets cache .*HF_DATASETS_OFFLINE=1"):
        formats.read_rows("trl-lib/Capybara")
    # no offline variable, and the Hub does not answer (a closed port on this machine): the probe fails fast,
    # the cache is still read, and what is not cached is refused naming why the Hub was not tried
    for var in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", False)
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")
    assert len(formats.read_rows(REPO)) == 6
    with pytest.raises(UserError, match=r"the Hub was not tried \(http://127.0.0.1:9 did not answer"):
        formats.read_rows("trl-lib/Capybara:train")
    assert time.perf_counter() - t < 10  # datasets' own retries take ~25 s here
    with pytest.raises(UserError, match="not found: give a"):  # a missing file is not a Hub id
        formats.read_rows("missing/train.jsonl")


def test_sft_trains_on_a_hub_dataset(hub_cache, tmp_path):
    out = tmp_path / "sft"
    assert main(["sft", "model=tiny-random", f"data={REPO}", f"eval_data={REPO}:test", "max_steps=1", "batch_size=2",
                 "sample_every=0", "forgetting_probe=false", "progress=false", f"output_dir={out}"]) == 0
    assert (out / "final" / "config.json").is_file()


def test_mixture_counts_are_exact_and_the_draw_is_seeded(tmp_path):
    from posttrain.data import sources

    a = write_jsonl(tmp_path / "a.jsonl", sft_rows(10, "a"))
    b = write_jsonl(tmp_path / "b.jsonl", sft_rows(100, "b"))
    # N = min(10 / 0.7, 100 / 0.3) = 14.29: floor(0.7 N) = 10 rows of a (all), floor(0.3 N) = 4 of b
    assert sources.mixture_counts([10, 100], [0.7, 0.3]) == [10, 4]
    assert sources.mixture_counts([10, 100], [7, 3]) == [10, 4]  # weights are normalised
    assert sources.mixture_counts([50, 50], [1, 1]) == [50, 50]
    rows = formats.read_rows(f"{a}:0.7,{b}:0.3", seed=1)
    assert len(rows) == 14 and sum(r.source == a for r in rows) == 10 and sum(r.source == b for r in rows) == 4
    assert len({(r.source, r.number) for r in rows}) == 14  # no row twice
    assert rows[0].data == sft_rows(100, "b")[rows[0].number - 1] or rows[0].source == a  # rows keep file and line
    again = formats.read_rows(f"{a}:0.7,{b}:0.3", seed=1)
    other = formats.read_rows(f"{a}:0.7,{b}:0.3", seed=2)
    key = lambda rs: [(r.source, r.number) for r in rs]
    assert key(again) == key(rows) and key(other) != key(rows)
    mixed = formats.read_rows(f"{a}:1,arithmetic:20:1")  # a task's count, then the weight
    assert sum(r.source == "task:arithmetic:20" for r in mixed) == 10
    for bad in (f"{a},{b}:0.3", f"{a}:0,{b}:1", f"{a}:x,{b}:1"):
        with pytest.raises(UserError, match="needs a positive weight"):
            formats.read_rows(bad)


def test_mixture_with_a_hub_dataset(hub_cache, tmp_path):
    a = write_jsonl(tmp_path / "a.jsonl", sft_rows(3, "a"))
    rows = formats.read_rows(f"{a}:0.5,{REPO}:0.5", seed=0)
    assert sorted(r.source for r in rows) == [a] * 3 + [REPO] * 3


# ---------------------------------------------------------------- TRL's columns


def trl_sft_ids(tok, example: dict) -> tuple[list[int], list[int]]:
    """How TRL's SFTTrainer reads a row (trl/trainer/sft_trainer.py, tokenize): "prompt" in the row means the
    prompt-completion case, `example["prompt"] + example["completion"]` (so both lists or both strings);
    conversational rows through the chat template; else `messages`. -> (ids, completion mask)."""
    if "prompt" in example:
        prompt, full = example["prompt"], example["prompt"] + example["completion"]
        if isinstance(prompt, list):
            prompt_ids = tok.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True, return_dict=False)
            ids = tok.apply_chat_template(full, tokenize=True, return_dict=False)
        else:
            prompt_ids, ids = tok(prompt)["input_ids"], tok(full + tok.eos_token)["input_ids"]
        return ids, [0] * len(prompt_ids) + [1] * (len(ids) - len(prompt_ids))
    ids = tok.apply_chat_template(example["messages"], tokenize=True, return_dict=False)
    return ids, [1] * len(ids)


def same_training_tokens(tok, example: dict) -> None:
    """posttrain's SFT rendering of the row has TRL's ids; its trained tokens are TRL's completion tokens
    (ChatML's newline after <|im_end|> aside, which posttrain leaves untrained)."""
    from posttrain.data.templates import render_row

    row = formats.Row(example, "test", 1)
    fmt = formats.validate([row], ("prompt_completion", "conversation", "text"))
    got = render_row(tok, example, fmt)
    ids, mask = trl_sft_ids(tok, example)
    assert got.input_ids == ids
    trained = [i for i, m in enumerate(got.loss_mask) if m]
    trl_trained = [i for i, m in enumerate(mask) if m]
    assert trained == trl_trained[: len(trained)] and ids[len(trained) + trl_trained[0]:] in ([], tok("\n")["input_ids"])


def test_generate_output_trains_in_sft_and_has_trls_columns(tmp_path, tiny_tok):
    prompts = write_jsonl(tmp_path / "prompts.jsonl", [{"prompt": [{"role": "user", "content": "Count to 3."}], "answer": "3"},
                                                      {"prompt": "Count to 4.", "answer": "4"}])
    samples = tmp_path / "samples.jsonl"
    assert main(["generate", "model=tiny-random", f"data={prompts}", "n=2", "max_new_tokens=6", "temperature=0",
                 "ignore_eos=true", f"output={samples}"]) == 0
    rows = [json.loads(line) for line in samples.read_text().splitlines()]
    assert len(rows) == 4
    for row in rows:
        # the chat template was applied to both prompts: both are conversations, the completion one assistant turn
        assert row["prompt"][-1]["role"] == "user" and row["completion"] == [{"role": "assistant", "content": row["text"]}]
        assert row["messages"] == row["prompt"] + row["completion"] and row["answer"] in ("3", "4")
        same_training_tokens(tiny_tok, {k: row[k] for k in ("prompt", "completion")})
    assert rows[2]["prompt"] == [{"role": "user", "content": "Count to 4."}]
    out = tmp_path / "sft"
    assert main(["sft", "model=tiny-random", f"data={samples}", "max_steps=1", "batch_size=2", "eval_fraction=0",
                 "sample_every=0", "forgetting_probe=false", "progress=false", f"output_dir={out}"]) == 0
    assert json.loads((out / "metrics.jsonl").read_text().splitlines()[0])["loss_tokens"] > 0


def test_a_task_written_to_a_file_has_trls_columns(tmp_path, tiny_tok):
    import datasets

    path = tmp_path / "arithmetic.jsonl"
    assert main(["data", "export", "data=arithmetic:8", f"output={path}"]) == 0
    ds = datasets.load_dataset("json", data_files=str(path), split="train", cache_dir=str(tmp_path / "c"))  # as a TRL user loads it
    assert {"prompt", "completion", "answer"} <= set(ds.column_names)
    for example in ds:
        assert example["messages"] == example["prompt"] + example["completion"]
        same_training_tokens(tiny_tok, {"prompt": example["prompt"], "completion": example["completion"]})
    # posttrain reads the same file as it reads the task: the same tokens trained
    from posttrain.data.templates import render_row

    task = formats.read_rows("arithmetic:8")
    assert [r.data for r in formats.read_rows(str(path))] == [r.data for r in task]
    a = render_row(tiny_tok, task[0].data, "prompt_completion")
    b = render_row(tiny_tok, {"messages": task[0].data["messages"]}, "conversation")
    assert (a.input_ids, a.loss_mask) == (b.input_ids, b.loss_mask)
