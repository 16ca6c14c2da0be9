"""Language names and codes: the model knows its languages by English name ('english', 'german', ...); clients
may also send the ISO 639-1 code ('en', 'de', ...), alone or with a region ('en-US', 'pt_BR'), in any case.

`canonical_language` maps whatever a client sent onto the model's name (a value that is neither is returned lower
case, for the caller's check against the engine's `languages` to refuse); `describe_languages` is the list an
error shows.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

# ISO 639-1 code -> the name Qwen3-TTS's checkpoints use (config.json's codec_language_id keys).
ISO_639_1 = {
    "zh": "chinese",
    "en": "english",
    "de": "german",
    "it": "italian",
    "pt": "portuguese",
    "es": "spanish",
    "ja": "japanese",
    "ko": "korean",
    "fr": "french",
    "ru": "russian",
}
_NAME_CODES = {name: code for code, name in ISO_639_1.items()}
# A two-letter code, optionally with a region or script subtag (BCP 47's 'en-US', POSIX locales' 'pt_BR').
_TAG = re.compile(r"^([a-z]{2})(?:[-_][a-z0-9]{2,8})*$")


def canonical_language(value: str) -> str:
    """The model's name for `value` ('en' -> 'english', 'English' -> 'english', 'pt-BR' -> 'portuguese');
    anything else lower case and stripped, as it came."""
    key = value.strip().lower()
    tag = _TAG.fullmatch(key)
    if tag and tag.group(1) in ISO_639_1:
        return ISO_639_1[tag.group(1)]
    return key


def describe_languages(names: Iterable[str]) -> str:
    """'Auto, Chinese (zh), English (en), ...': the accepted names, each with its code where it has one."""
    return ", ".join(
        f"{name.capitalize()} ({_NAME_CODES[name]})" if name in _NAME_CODES else name.capitalize() for name in names
    )
