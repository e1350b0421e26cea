"""Datasets (layer 3, beside `posttrain.algos`; imports only `errors` and `ops`): formats and their
checks (`formats`, `preference`), chat templates with an exact loss mask (`templates`), packing and
collation (`packing`), the prompt-once layout of preference batches (`prefix_batch`) and built-in tasks
(`tasks/`).
"""
