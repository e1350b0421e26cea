"""Language-consistency reward: the share of the response written in the target language.

DeepSeek-R1 (2025, §2.3.2) adds "the proportion of target language words in the CoT" to stop
language mixing. Here the language is identified by script, which needs no model: letters are
classified as CJK (Han, kana, Hangul), Latin, Cyrillic, Arabic, ... and the reward is

    r = (letters in the target script) / (all letters)      (None when there are no letters)

Code blocks, inline math and LaTeX commands are removed first (they are Latin by construction).
Target per sample from the `language` column if present, else the `target` option. Accepted:
a script name (latin, cjk, cyrillic, arabic, greek, hebrew, devanagari, thai) or a language code
(en, fr, de, es, zh, ja, ko, ru, ar, ...).
"""

from __future__ import annotations

import re
import unicodedata

from posttrain.rewards.base import completion_text, register

_LANG_SCRIPT = {
    "en": "latin", "fr": "latin", "de": "latin", "es": "latin", "it": "latin", "pt": "latin", "nl": "latin",
    "vi": "latin", "id": "latin", "tr": "latin", "pl": "latin", "zh": "cjk", "ja": "cjk", "ko": "cjk",
    "ru": "cyrillic", "uk": "cyrillic", "ar": "arabic", "fa": "arabic", "el": "greek", "he": "hebrew",
    "hi": "devanagari", "th": "thai",
}
_UNICODE_NAMES = {"LATIN": "latin", "CJK": "cjk", "HIRAGANA": "cjk", "KATAKANA": "cjk", "HANGUL": "cjk",
                  "CYRILLIC": "cyrillic", "ARABIC": "arabic", "GREEK": "greek", "HEBREW": "hebrew",
                  "DEVANAGARI": "devanagari", "THAI": "thai"}
_STRIP = re.compile(r"```.*?```|`[^`]*`|\$\$.*?\$\$|\$[^$]*\$|\\[a-zA-Z]+|<[^>]{1,20}>", re.S)


def script_of(ch: str) -> str:
    if "a" <= ch.lower() <= "z":
        return "latin"
    try:
        first = unicodedata.name(ch).split()[0]
    except ValueError:
        return "other"
    return _UNICODE_NAMES.get(first, "other")


def script_share(text: str, target: str) -> float | None:
    script = _LANG_SCRIPT.get(target.lower(), target.lower())
    counts = total = 0
    for ch in _STRIP.sub(" ", text):
        if ch.isalpha():
            total += 1
            counts += script_of(ch) == script
    return counts / total if total else None


def make_language_reward(target: str = "en"):
    """Build a language-consistency reward for `target` (overridden per sample by `language`)."""
    if _LANG_SCRIPT.get(target.lower(), target.lower()) not in set(_UNICODE_NAMES.values()):
        raise ValueError(f"unknown language or script '{target}'")

    def language_reward(prompts, completions, language=None, **_):
        langs = language if language is not None else [target] * len(completions)
        return [script_share(completion_text(c), lang or target) for c, lang in zip(completions, langs)]

    return language_reward


register("language", factory=make_language_reward,
         description="share of letters in the target script (column `language`, default en)")(make_language_reward())
