"""Models (layer 4, beside `monitor` and `judge`): loading a policy and its tokenizer (`loading`), built-in and
fetched models (`builtin`, `fetch`, `posttrain models`), LoRA (`lora`), reward and value heads
(`reward_head`, `value`), the shared forward passes (`forward`) and the device a run computes on (`device`).
"""
