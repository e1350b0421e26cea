"""lm-evaluation-harness (the pinned `lm-eval[api]` of the `eval` extra) against `posttrain serve`: a generate_until and a
multiple_choice task on local JSONL files, run with lm-eval's own `hf` model on a saved tiny random checkpoint and with
`local-completions` (token-id requests, lm-eval's default) and `local-chat-completions` against the server serving the
same folder: the same scores, the same generations, the same log-likelihoods."""

import json
import math

import pytest

lm_eval = pytest.importorskip("lm_eval", reason="lm-evaluation-harness is not installed: pip install -e '.[eval]'")

QUESTIONS = ["What is two plus two?", "Name a colour.", "Count to three.", "Say hello.", "What is the capital of France?",
             "Spell cat.", "Is water wet?", "Write a number."]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A tiny random model saved with the project's tiny tokenizer: what lm-eval's `hf` model loads."""
    from posttrain.models.builtin import build_tiny
    from posttrain.models.loading import load_tokenizer

    path = tmp_path_factory.mktemp("tiny-ckpt")
    build_tiny("tiny-random").save_pretrained(path)
    load_tokenizer("tiny-random").save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def tasks(tmp_path_factory):
    """Two tasks on local JSONL (no Hub): generate_until with stop sequences, multiple_choice (acc, acc_norm)."""
    d = tmp_path_factory.mktemp("lm_eval_tasks")
    with open(d / "gen.jsonl", "w") as f:
        for i, q in enumerate(QUESTIONS):
            f.write(json.dumps({"question": q, "answer": str(i)}) + "\n")
    with open(d / "mc.jsonl", "w") as f:
        for i, q in enumerate(QUESTIONS):
            f.write(json.dumps({"question": q, "choices": ["yes", "no", "maybe so", f"{i} apples"], "label": i % 2}) + "\n")
    common = "dataset_path: json\ntest_split: test\n"
    (d / "pt_gen.yaml").write_text(
        f"task: pt_gen\n{common}dataset_kwargs:\n  cache_dir: {d / 'cache'}\n  data_files:\n    test: {d / 'gen.jsonl'}\n"
        "output_type: generate_until\ndoc_to_text: \"Question: {{question}}\\nAnswer:\"\ndoc_to_target: \"{{answer}}\"\n"
        "generation_kwargs:\n  until: [\"\\n\\n\", \".\", \"?\"]\n  max_gen_toks: 12\n  do_sample: false\n"
        "metric_list:\n  - metric: exact_match\n    aggregation: mean\n    higher_is_better: true\n")
    (d / "pt_mc.yaml").write_text(
        f"task: pt_mc\n{common}dataset_kwargs:\n  cache_dir: {d / 'cache'}\n  data_files:\n    test: {d / 'mc.jsonl'}\n"
        "output_type: multiple_choice\ndoc_to_text: \"Question: {{question}}\\nAnswer:\"\ndoc_to_choice: choices\n"
        "doc_to_target: label\nmetric_list:\n  - metric: acc\n  - metric: acc_norm\n")
    return str(d)


@pytest.fixture(scope="module")
def server(checkpoint):
    from posttrain.rollout.serve import ServeConfig, ServerThread, build_worker, make_app

    worker, tok = build_worker(ServeConfig(model=checkpoint, max_num_seqs=8, kv_cache_mb=32, max_model_len=1024))
    with ServerThread(make_app(worker, tok, "tiny", 16)) as srv:
        yield srv.base_url
    worker.close()


def evaluate(model: str, model_args: str, task_dir: str, names: list[str], **kw) -> dict:
    from lm_eval.tasks import TaskManager

    return lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=names, task_manager=TaskManager(include_path=task_dir),
                                   device="cpu", batch_size=1, log_samples=True, bootstrap_iters=0, **kw)


def per_sample(res: dict, task: str) -> list:
    return [s["filtered_resps"] for s in sorted(res["samples"][task], key=lambda s: (s["doc_id"]))]


def scores(res: dict, task: str) -> dict:
    return {k: v for k, v in res["results"][task].items() if k != "alias" and "stderr" not in k}


def test_local_completions_scores_equal_lm_evals_hf_model(checkpoint, tasks, server):
    """Token-id requests (tokenized_requests=True, lm-eval's default): generations are the same strings, and the
    multiple-choice log-likelihoods (echo + logprobs, the prompt's own log-probs) the same numbers."""
    hf = evaluate("hf", f"pretrained={checkpoint},dtype=float32", tasks, ["pt_gen", "pt_mc"])
    api = evaluate("local-completions", f"model=tiny,base_url={server}/completions,tokenizer={checkpoint},max_retries=1",
                   tasks, ["pt_gen", "pt_mc"])
    for task in ("pt_gen", "pt_mc"):
        assert scores(api, task) == scores(hf, task), task
    gen_hf, gen_api = per_sample(hf, "pt_gen"), per_sample(api, "pt_gen")
    assert gen_api == gen_hf and any(g[0].strip() for g in gen_hf)  # the random model writes something
    for h, a in zip(per_sample(hf, "pt_mc"), per_sample(api, "pt_mc")):  # per choice: (log-likelihood, is_greedy)
        assert [x[1] for x in a] == [x[1] for x in h]
        assert all(math.isclose(x[0], y[0], rel_tol=0, abs_tol=1e-5) for x, y in zip(a, h)), (a, h)
    acc = scores(hf, "pt_mc")["acc,none"]
    assert 0 < acc < 1  # a score that could have differed


def test_local_chat_completions_generations_equal_hf_with_chat_template(checkpoint, tasks, server):
    hf = evaluate("hf", f"pretrained={checkpoint},dtype=float32", tasks, ["pt_gen"], apply_chat_template=True)
    api = evaluate("local-chat-completions", f"model=tiny,base_url={server}/chat/completions,max_retries=1", tasks,
                   ["pt_gen"], apply_chat_template=True)
    assert scores(api, "pt_gen") == scores(hf, "pt_gen")
    assert per_sample(api, "pt_gen") == per_sample(hf, "pt_gen")
