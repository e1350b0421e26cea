"""Build the project's small test tokenizer (byte-level BPE, 1,024 tokens, ChatML template).

Committed output: posttrain/assets/tiny-tokenizer/. Byte-level, so any text round-trips; small, so
tiny random models stay fast. Regenerate with `python scripts/make_tiny_tokenizer.py`.
"""

from __future__ import annotations

import random
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

OUT = Path(__file__).resolve().parent.parent / "posttrain" / "assets" / "tiny-tokenizer"
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|pad|>"]
CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

PROSE = """The quick brown fox jumps over the lazy dog. A policy generates tokens; a reward scores them.
What is the answer? Let me think step by step. The answer is 42. Therefore the final answer is \\boxed{7}.
You are a helpful assistant. Please solve the following problem and put the answer in a box.
def add(a, b):\n    return a + b\nassert add(2, 3) == 5\nprint("hello world")
The user asked a question and the assistant answered politely, with care and precision.
Reinforcement learning from human feedback aligns language models with preferences.
<think>I should add the numbers.</think><answer>12</answer> #### 18
"""


def corpus(seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    lines = PROSE.splitlines() * 20
    for _ in range(3000):
        a, b = rng.randint(0, 999), rng.randint(0, 999)
        op = rng.choice("+-*")
        lines.append(f"What is {a} {op} {b}? {a} {op} {b} = {eval(f'{a}{op}{b}')}.")
    return lines


def main() -> None:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=1024,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=None,
        eos_token="<|im_end|>",
        pad_token="<|pad|>",
        unk_token=None,
        additional_special_tokens=["<|endoftext|>", "<|im_start|>"],
    )
    fast.chat_template = CHATML
    fast.model_max_length = 2048
    OUT.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(OUT)
    print(f"wrote {OUT} ({len(fast)} tokens)")


if __name__ == "__main__":
    main()
