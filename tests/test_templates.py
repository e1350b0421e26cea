"""The assistant-only mask on multi-turn conversations, for several template styles, verified by decoding."""

import copy

import pytest

from posttrain.data.templates import TemplateError, render_messages, render_prompt, render_prompt_completion

CHATML = None  # the tiny tokenizer's own template

SMOLLM2 = (  # verbatim from SmolLM2-135M-Instruct: injects a default system prompt
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\n"
    "You are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

LLAMA3 = (  # Llama-3 style: bos, header ids, trimmed content, <|eot_id|>
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] | trim + '<|eot_id|>' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)

MISTRAL = (  # [INST] style: no role header for the assistant, </s> closes each answer
    "{{ bos_token }}{% for message in messages %}{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ ' ' + message['content'] + eos_token }}{% endif %}{% endfor %}"
)

STYLES = {
    "chatml": (CHATML, "<|im_end|>", {}),
    "smollm2_default_system": (SMOLLM2, "<|im_end|>", {}),
    "llama3": (LLAMA3, "<|eot_id|>", {"bos_token": "<|begin_of_text|>", "additional_special_tokens": ["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]}),
    "mistral_inst": (MISTRAL, "</s>", {"bos_token": "<s>", "eos_token": "</s>"}),
}

CONV = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "4"},
    {"role": "user", "content": "And times 3?"},
    {"role": "assistant", "content": "That makes 12, since 4 * 3 = 12."},
    {"role": "user", "content": "Thanks"},
    {"role": "assistant", "content": "You're welcome!"},
]


def styled(tok, style):
    template, eot, specials = STYLES[style]
    tok = copy.deepcopy(tok)
    if specials:
        tok.add_special_tokens(specials)
    if template:
        tok.chat_template = template
    return tok, eot


@pytest.mark.parametrize("style", list(STYLES))
@pytest.mark.parametrize("with_system", [True, False])
def test_mask_is_exactly_assistant_turns(tiny_tok, style, with_system):
    tok, eot = styled(tiny_tok, style)
    messages = CONV if with_system else CONV[1:]
    if style == "mistral_inst":
        messages = [m for m in messages if m["role"] != "system"]
    out = render_messages(tok, messages)
    answers = [m["content"] for m in messages if m["role"] == "assistant"]
    assert len(out.spans) == len(answers)
    for (s, e), answer in zip(out.spans, answers):
        assert tok.decode(out.input_ids[s:e]).strip() == answer + eot
    # nothing outside the spans is trained, and the whole rendering is preserved
    trained = {i for s, e in out.spans for i in range(s, e)}
    assert [i for i, m in enumerate(out.loss_mask) if m] == sorted(trained)
    full = tok.apply_chat_template(messages, tokenize=False)
    assert tok.decode(out.input_ids) == full
    # no header of the next turn leaks into a span
    for s, e in out.spans:
        text = tok.decode(out.input_ids[s:e])
        assert "user" not in text and "[INST]" not in text and "<|start_header_id|>" not in text


def test_default_system_prompt_is_never_trained(tiny_tok):
    tok, _ = styled(tiny_tok, "smollm2_default_system")
    out = render_messages(tok, CONV[1:3])
    untrained = tok.decode([t for t, m in zip(out.input_ids, out.loss_mask) if not m])
    assert "You are a helpful AI assistant named SmolLM" in untrained


def test_prompt_completion_conversational_trains_only_completion(tiny_tok):
    out = render_prompt_completion(tiny_tok, CONV[:3], [{"role": "assistant", "content": "Done."}])
    assert len(out.spans) == 1  # the assistant turn inside the prompt is context, not a target
    s, e = out.spans[0]
    assert tiny_tok.decode(out.input_ids[s:e]) == "Done.<|im_end|>"


def test_prompt_completion_plain_appends_eos(tiny_tok):
    out = render_prompt_completion(tiny_tok, "2+2=", "4")
    s, e = out.spans[0]
    assert out.input_ids[e - 1] == tiny_tok.eos_token_id and tiny_tok.decode(out.input_ids[s:e - 1]) == "4"


def test_prompt_ends_with_generation_header(tiny_tok):
    ids = render_prompt(tiny_tok, CONV[1:2])
    assert tiny_tok.decode(ids).endswith("<|im_start|>assistant\n")


def test_template_that_rewrites_history_is_refused(tiny_tok):
    tok = copy.deepcopy(tiny_tok)
    # drops the content of every assistant turn but the last (like reasoning-stripping templates)
    tok.chat_template = (
        "{% for m in messages %}{% if m['role'] == 'assistant' and not loop.last %}{{ '<|im_start|>assistant\n...<|im_end|>\n' }}"
        "{% else %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
    )
    with pytest.raises(TemplateError, match="prefix"):
        render_messages(tok, CONV[1:])
