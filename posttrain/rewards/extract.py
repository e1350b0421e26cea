"""Final-answer extraction for math rewards (pure string work, no sympy).

- `boxed_all`: every `\\boxed{...}` / `\\fbox{...}` (nested braces balanced) and `\\boxed 5`;
- `gsm8k`: the text after the last `####` (GSM8K's convention, Cobbe et al. 2021);
- `last_number`: the last integer / decimal / fraction in the text;
- `final_region`: what counts as the final answer when a format is required — the last
  `<answer>...</answer>` block, or the text after the last `</think>`; None when the format is
  missing (the reward is then 0: an answer only inside the reasoning does not count).
"""

from __future__ import annotations

import re

_BOX = re.compile(r"\\(?:boxed|fbox)\s*")
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?(?:/\d+)?|-?\.\d+")


def boxed_all(text: str) -> list[str]:
    """Contents of every boxed expression, in order. An unbalanced `\\boxed{` is ignored."""
    out = []
    for m in _BOX.finditer(text):
        i = m.end()
        if i < len(text) and text[i] == "{":
            depth, j = 0, i
            while j < len(text):
                c = text[j]
                if c == "\\" and j + 1 < len(text):  # skip escaped chars such as \{ \}
                    j += 2
                    continue
                if c == "{":
                    depth += 1
                elif c == "}":
                    depth -= 1
                    if depth == 0:
                        out.append(text[i + 1:j].strip())
                        break
                j += 1
        elif i < len(text) and m.group(0).endswith(" "):  # "\boxed 5"
            tok = re.match(r"[^\s$]+", text[i:])
            if tok:
                out.append(tok.group(0))
    return out


def gsm8k(text: str) -> str | None:
    if "####" not in text:
        return None
    ans = text.rsplit("####", 1)[1].strip().split("\n")[0].strip()
    return ans.replace(",", "").rstrip(".") or None


def last_number(text: str) -> str | None:
    nums = _NUMBER.findall(text)
    return nums[-1].replace(",", "").rstrip(".") if nums else None


def final_region(text: str, require: str | None) -> str | None:
    """The part of the completion where the final answer must be (None = format missing)."""
    if require in (None, "", "none"):
        return text
    if require == "answer_tag":
        blocks = re.findall(r"<answer>(.*?)</answer>", text, flags=re.S)
        if not blocks:
            return None
        # an <answer> written inside <think> is reasoning, not the final answer
        after = text.rsplit("</think>", 1)[1] if "</think>" in text else text
        if "<think>" in text and "<answer>" not in after:
            return None
        return blocks[-1]
    if require == "after_think":
        if "</think>" not in text:
            return None
        return text.rsplit("</think>", 1)[1]
    raise ValueError(f"unknown final format '{require}' (none, answer_tag, after_think)")


def strip_restated(text: str, prompt: str | None) -> str:
    """Remove a verbatim copy of the question, so numbers from a restated prompt are not read as
    the answer by `last_number`."""
    if prompt and len(prompt) >= 20 and prompt in text:
        return text.replace(prompt, " ")
    return text


def candidates(text: str, mode: str = "auto") -> list[str]:
    """Answer candidates in the region: all boxed ones (mode boxed/auto), else #### / last number."""
    if mode in ("boxed", "auto"):
        boxed = boxed_all(text)
        if boxed or mode == "boxed":
            return boxed
    if mode in ("gsm8k", "auto"):
        g = gsm8k(text)
        if g is not None or mode == "gsm8k":
            return [g] if g is not None else []
    if mode in ("last_number", "auto"):
        n = last_number(text)
        return [n] if n is not None else []
    if mode == "raw":
        return [text.strip()] if text.strip() else []
    raise ValueError(f"unknown extraction mode '{mode}' (auto, boxed, gsm8k, last_number, raw)")
