"""The batch manifest: a JSON list of synthesis items, parsed and validated as a whole before any work starts.

Format (docs/tools.md): either a list of items or `{"defaults": {...}, "items": [...]}`. An item has `speaker_id`,
`text`, and optionally `id` (also the default output file stem; derived from `output` when absent, so the seed's
`{"speaker_id", "text", "language", "output"}` items work as written), `language`, `seed`, `format` (derived from
the output's extension when absent), `output` (a relative path under the output directory), `voice_mode` (auto: ICL
for a voice with ICL data, else x-vector; icl; xvector) and `options` (sampling settings of
`qwen_tts.engine_api.SynthesisRequest`).
Every problem is collected in one pass, so a user fixes a manifest at once instead of one error per run: with the
`speakers` and `languages` it is checked against, an item's unknown voice or language is reported beside its other
problems, not in a later round once they are fixed. `language` takes a name or an ISO 639-1 code ('en');
`seed` is 0 ... MAX_SEED, the range of the HTTP API, so an item can be replayed over HTTP with its seed.
"""

from __future__ import annotations

import hashlib
import json
import os
import posixpath
import re
from collections.abc import Collection
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypedDict

from qwen_tts.engine_api import MAX_SEED
from qwen_tts.languages import canonical_language, describe_languages

if TYPE_CHECKING:
    from typing_extensions import Unpack  # typing.Unpack from Python 3.11 on

# One path component of an output name; ids use the same alphabet because they become file stems.
NAME_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")
MAX_OUTPUT_DEPTH = 4
AUDIO_FORMATS = ("wav", "flac", "ogg", "mp3")

ITEM_KEYS = frozenset({"id", "speaker_id", "text", "language", "seed", "format", "output", "voice_mode", "options"})
DEFAULT_KEYS = frozenset({"speaker_id", "language", "format", "voice_mode", "options"})
VOICE_MODES = ("auto", "icl", "xvector")  # as the HTTP API's voice_mode

# name -> (type, check, description); bool is tested before int because bool is a subclass of int in Python.
_NUMBER = (int, float)
OPTION_RULES: dict[str, tuple[tuple[type, ...], Any, str]] = {
    "temperature": (_NUMBER, lambda v: v > 0, "a number > 0"),
    "top_k": ((int,), lambda v: v >= 0, "an integer >= 0"),
    "top_p": (_NUMBER, lambda v: 0 < v <= 1, "a number in (0, 1]"),
    "repetition_penalty": (_NUMBER, lambda v: v > 0, "a number > 0"),
    "cp_temperature": (_NUMBER, lambda v: v > 0, "a number > 0"),
    "cp_top_k": ((int,), lambda v: v >= 0, "an integer >= 0"),
    "cp_top_p": (_NUMBER, lambda v: 0 < v <= 1, "a number in (0, 1]"),
    "greedy": ((bool,), lambda v: True, "true or false"),
    "non_streaming_text": ((bool,), lambda v: True, "true or false"),
    "max_frames": ((int,), lambda v: v >= 1, "an integer >= 1"),
    "min_frames": ((int,), lambda v: v >= 0, "an integer >= 0"),
}


class ManifestError(ValueError):
    """The manifest cannot be used; `problems` lists every reason, one line each."""

    def __init__(self, problems: list[str]):
        super().__init__(f"{len(problems)} problem(s) in the manifest")
        self.problems = problems


@dataclass(frozen=True)
class ManifestItem:
    id: str
    speaker_id: str
    text: str
    output: str  # relative to the output directory, '/'-separated
    format: str = "wav"
    language: str = "auto"
    seed: int | None = None
    options: dict[str, Any] = field(default_factory=dict)
    index: int = 0  # position in the manifest, for messages
    voice_mode: str = "auto"


def derive_seed(base_seed: int, item_id: str) -> int:
    """A per-item seed from the run's base seed and the item id: stable under reordering and --resume, and
    within the HTTP API's seed range (31 bits of 0 ... MAX_SEED)."""
    digest = hashlib.sha256(f"{base_seed}:{item_id}".encode()).digest()
    return int.from_bytes(digest[:4], "little") & 0x7FFFFFFF


def _is_name(s: str) -> bool:
    return bool(NAME_PATTERN.fullmatch(s))


def derive_id(output: str) -> str:
    """The id of an item that has only an `output`: its path without the extension, '/' turned into '.'
    ('a.wav' -> 'a', 'ch1/003.mp3' -> 'ch1.003'), so it is a name of the id alphabet."""
    return posixpath.splitext(output)[0].replace("/", ".")


def _format_of(output: Any) -> str | None:
    """The audio format an output name's extension states, if it is one of ours."""
    if isinstance(output, str) and "." in output:
        ext = output.rpartition(".")[2].lower()
        if ext in AUDIO_FORMATS:
            return ext
    return None


def _check_options(opts: Any, where: str, problems: list[str]) -> dict[str, Any]:
    if not isinstance(opts, dict):
        problems.append(f"{where}: 'options' must be an object")
        return {}
    for key, value in opts.items():
        rule = OPTION_RULES.get(key)
        if rule is None:
            problems.append(f"{where}: unknown option {key!r} (known: {', '.join(sorted(OPTION_RULES))})")
            continue
        types, ok, desc = rule
        is_bool = isinstance(value, bool)
        if (is_bool and bool not in types) or not isinstance(value, types) or not ok(value):
            problems.append(f"{where}: option {key!r} must be {desc}, got {value!r}")
    return dict(opts)


def _output_path(item_id: str, fmt: str, output: Any, where: str, problems: list[str]) -> str | None:
    if output is None:
        return f"{item_id}.{fmt}"
    if not isinstance(output, str) or not output:
        problems.append(f"{where}: 'output' must be a non-empty relative path")
        return None
    parts = output.split("/")
    if len(parts) > MAX_OUTPUT_DEPTH or not all(_is_name(p) for p in parts):
        problems.append(
            f"{where}: unsafe output name {output!r} (up to {MAX_OUTPUT_DEPTH} '/'-separated parts, "
            "each letters, digits, '_', '.', '-', starting with a letter or digit)"
        )
        return None
    if not output.lower().endswith(f".{fmt}"):
        problems.append(f"{where}: output {output!r} does not end in .{fmt} (the item's format)")
        return None
    return output


class ManifestChecks(TypedDict, total=False):
    """The keywords of `collect_items` beside the data (their defaults are there)."""

    default_format: str
    base_seed: int | None
    speakers: Collection[str] | None
    languages: Collection[str] | None


def parse_manifest(data: Any, **checks: Unpack[ManifestChecks]) -> list[ManifestItem]:
    """Turn decoded JSON into items; raises ManifestError listing every problem (with `speakers` and `languages`,
    unknown ones too)."""
    items, problems = collect_items(data, **checks)
    if problems:
        raise ManifestError(problems)
    return items


def _raw_items(data: Any) -> tuple[dict[str, Any], list[Any]]:
    """(defaults, items) as written, whatever their shape (checked by `collect_items`)."""
    if isinstance(data, dict):
        defaults = data.get("defaults")
        items = data.get("items")
        return (defaults if isinstance(defaults, dict) else {}), (items if isinstance(items, list) else [])
    return {}, data if isinstance(data, list) else []


def referenced_speakers(data: Any) -> set[str]:
    """Every speaker id the manifest names (items' and the defaults'), also those of items with other problems:
    the voices to load before `collect_items` checks each item against them."""
    defaults, items = _raw_items(data)
    named = {raw.get("speaker_id", defaults.get("speaker_id")) for raw in items if isinstance(raw, dict)}
    return {s for s in named if isinstance(s, str) and s}


def collect_items(
    data: Any,
    *,
    default_format: str = "wav",
    base_seed: int | None = None,
    speakers: Collection[str] | None = None,
    languages: Collection[str] | None = None,
) -> tuple[list[ManifestItem], list[str]]:
    """The usable items and every problem of the others, in one pass. With `speakers` (the voices there are) and
    `languages` (the engine's), an item naming another is a problem too, reported beside the item's others."""
    problems: list[str] = []
    defaults: dict[str, Any] = {}
    if isinstance(data, dict):
        unknown = set(data) - {"items", "defaults"}
        if unknown:
            problems.append(f"manifest: unknown top-level key(s) {sorted(unknown)} (expected 'items', 'defaults')")
        raw_defaults = data.get("defaults", {})
        if not isinstance(raw_defaults, dict):
            problems.append("manifest: 'defaults' must be an object")
        else:
            bad = set(raw_defaults) - DEFAULT_KEYS
            if bad:
                problems.append(f"defaults: unknown key(s) {sorted(bad)} (allowed: {sorted(DEFAULT_KEYS)})")
            defaults = {k: v for k, v in raw_defaults.items() if k in DEFAULT_KEYS}
        raw_items = data.get("items")
    else:
        raw_items = data
    if not isinstance(raw_items, list):
        return [], [*problems, "manifest: expected a list of items or an object with an 'items' list"]
    if not raw_items:
        return [], [*problems, "manifest: no items"]
    if "options" in defaults:
        defaults["options"] = _check_options(defaults["options"], "defaults", problems)

    items: list[ManifestItem] = []
    seen_ids: dict[str, int] = {}
    for i, raw in enumerate(raw_items):
        where = f"item {i}"
        if not isinstance(raw, dict):
            problems.append(f"{where}: must be an object")
            continue
        item_id = raw.get("id")
        derived = item_id is None and isinstance(raw.get("output"), str) and bool(raw["output"])
        if derived:
            item_id = derive_id(raw["output"])
        if isinstance(item_id, str):
            where = f"item {i} ({item_id!r})"
        n_before = len(problems)
        unknown = set(raw) - ITEM_KEYS
        if unknown:
            problems.append(f"{where}: unknown key(s) {sorted(unknown)} (allowed: {sorted(ITEM_KEYS)})")
        if item_id is None:
            problems.append(f"{where}: 'id' is missing (give an 'id', or an 'output' to derive it from)")
        elif derived and not _is_name(item_id):
            problems.append(
                f"{where}: no 'id', and output {raw['output']!r} gives no usable one ({item_id!r}); add an 'id'"
            )
        elif not isinstance(item_id, str) or not _is_name(item_id):
            problems.append(f"{where}: 'id' must be a name of letters, digits, '_', '.', '-' (got {item_id!r})")
        elif item_id in seen_ids:
            problems.append(f"{where}: duplicate id (first used by item {seen_ids[item_id]})")
        else:
            seen_ids[item_id] = i
        merged = {**defaults, **raw}
        speaker = merged.get("speaker_id")
        if not isinstance(speaker, str) or not speaker:
            problems.append(f"{where}: 'speaker_id' is missing")
        elif speakers is not None and speaker not in speakers:
            problems.append(f"{where}: unknown speaker_id {speaker!r}")
        text = raw.get("text")
        if not isinstance(text, str) or not text.strip():
            problems.append(f"{where}: 'text' is empty")
        language = merged.get("language", "auto")
        if not isinstance(language, str) or not language.strip():
            problems.append(f"{where}: 'language' must be a non-empty string")
        else:
            language = canonical_language(language)
            if languages is not None and language not in languages:
                problems.append(_unknown_language(where, merged["language"], languages))
        fmt = merged.get("format", _format_of(raw.get("output")) or default_format)
        if fmt not in AUDIO_FORMATS:
            problems.append(f"{where}: format {fmt!r} is not one of {', '.join(AUDIO_FORMATS)}")
        seed = raw.get("seed")
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= MAX_SEED):
            problems.append(
                f"{where}: 'seed' must be an integer from 0 to {MAX_SEED} (the HTTP API's range), got {seed!r}"
            )
        voice_mode = merged.get("voice_mode", "auto")
        if voice_mode not in VOICE_MODES:
            problems.append(f"{where}: 'voice_mode' must be one of {', '.join(VOICE_MODES)}, got {voice_mode!r}")
        options = {**defaults.get("options", {}), **_check_options(raw.get("options", {}), where, problems)}
        output = (
            _output_path(item_id, fmt, raw.get("output"), where, problems)
            if isinstance(item_id, str) and fmt in AUDIO_FORMATS
            else None
        )
        if len(problems) > n_before:
            continue
        if seed is None and base_seed is not None:
            seed = derive_seed(base_seed, item_id)
        items.append(
            ManifestItem(
                id=item_id,
                speaker_id=speaker,
                text=text,
                output=output,
                format=fmt,
                language=language,
                seed=seed,
                options=options,
                index=i,
                voice_mode=voice_mode,
            )
        )
    return items, problems


def _unknown_language(where: str, given: Any, languages: Collection[str]) -> str:
    return (
        f"{where}: unknown language {given!r} (known: {describe_languages(sorted(languages))}; a name in any case "
        "or its ISO 639-1 code)"
    )


def load_json(path: str | Path) -> Any:
    """Decode a manifest file; unreadable or malformed JSON becomes a one-line ManifestError."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise ManifestError([f"{path}: cannot read ({e.strerror or e})"]) from None
    except UnicodeDecodeError:
        raise ManifestError([f"{path}: not UTF-8 text"]) from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise ManifestError([f"{path}: invalid JSON at line {e.lineno} column {e.colno}: {e.msg}"]) from None


def read_manifest(path: str | Path, *, default_format: str = "wav", base_seed: int | None = None) -> list[ManifestItem]:
    """Read and parse a manifest file; raises ManifestError listing every problem."""
    return parse_manifest(load_json(path), default_format=default_format, base_seed=base_seed)


def resolve_output(output_dir: Path, output: str) -> Path | None:
    """The absolute output path, or None when it resolves (through symlinks too) outside `output_dir`."""
    root = output_dir.resolve()
    target = (root / output).resolve()
    if os.path.commonpath([root, target]) != str(root) or target == root:
        return None
    return target


def check_items(
    items: list[ManifestItem],
    *,
    output_dir: Path,
    speakers: Collection[str],
    languages: Collection[str] | None = None,
) -> list[str]:
    """Problems that need the outside world: clashing or escaping outputs, and (for items parsed without them)
    unknown speakers and languages."""
    problems: list[str] = []
    claimed: dict[str, str] = {}
    for item in items:
        where = f"item {item.index} ({item.id!r})"
        if item.speaker_id not in speakers:
            problems.append(f"{where}: unknown speaker_id {item.speaker_id!r}")
        if languages is not None and item.language not in languages:
            problems.append(_unknown_language(where, item.language, languages))
        target = resolve_output(output_dir, item.output)
        if target is None:
            problems.append(f"{where}: output {item.output!r} resolves outside the output directory")
            continue
        # Case-folded so that two names cannot silently share one file on case-insensitive filesystems.
        key = str(target).casefold()
        if key in claimed:
            problems.append(f"{where}: output {item.output!r} is also the output of item {claimed[key]!r}")
        else:
            claimed[key] = item.id
    return problems
