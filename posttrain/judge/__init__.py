"""The LLM judge: a client for any OpenAI-compatible chat endpoint and its frozen, versioned prompts.

    client.py   Judge (pairwise in both orders, rubric scores, retries, strict parsing, stats), JudgeSettings
    prompts.py  the released prompt texts (pairwise-v1, pairwise-direct-v1, score-v1, score-direct-v1), digests

Used by `reward=judge` (posttrain/rewards/judge.py) and `posttrain label` (posttrain/eval/label.py); it
depends on nothing above the data layer.
"""
