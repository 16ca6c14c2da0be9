"""The batch manifest: its two shapes, defaults, seeds, and every refusal reported at once."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from qwen_tts.engine_api import MAX_SEED
from qwen_tts.languages import ISO_639_1
from tts_tools.manifest import (
    ManifestError,
    check_items,
    derive_seed,
    parse_manifest,
    read_manifest,
    resolve_output,
)


def problems_of(data, **kw) -> list[str]:
    with pytest.raises(ManifestError) as e:
        parse_manifest(data, **kw)
    return e.value.problems


def test_plain_list_gives_items_with_default_output_names():
    items = parse_manifest([{"id": "a1", "speaker_id": "alice", "text": "Hello."}])
    assert len(items) == 1
    assert items[0].output == "a1.wav"
    assert items[0].language == "auto"
    assert items[0].seed is None
    assert items[0].options == {}


def test_defaults_apply_and_items_override_them():
    data = {
        "defaults": {"speaker_id": "alice", "language": "English", "format": "flac", "options": {"temperature": 0.7}},
        "items": [
            {"id": "a", "text": "One."},
            {"id": "b", "text": "Two.", "speaker_id": "bob", "format": "mp3", "options": {"top_k": 10}},
        ],
    }
    a, b = parse_manifest(data)
    assert (a.speaker_id, a.language, a.format, a.output) == ("alice", "english", "flac", "a.flac")
    assert a.options == {"temperature": 0.7}
    assert (b.speaker_id, b.format, b.output) == ("bob", "mp3", "b.mp3")
    assert b.options == {"temperature": 0.7, "top_k": 10}


def test_format_flag_is_the_default_for_items_without_format():
    (item,) = parse_manifest([{"id": "x", "speaker_id": "s", "text": "t"}], default_format="ogg")
    assert item.output == "x.ogg"


def test_base_seed_derives_stable_per_item_seeds_and_explicit_seed_wins():
    data = [{"id": "a", "speaker_id": "s", "text": "t"}, {"id": "b", "speaker_id": "s", "text": "t", "seed": 5}]
    a, b = parse_manifest(data, base_seed=123)
    assert a.seed == derive_seed(123, "a")
    assert b.seed == 5
    # Reordering the manifest must not change an item's seed (resume and partial reruns rely on it).
    _, a2 = parse_manifest(list(reversed(data)), base_seed=123)
    assert a2.seed == a.seed
    assert derive_seed(123, "a") != derive_seed(124, "a")
    assert derive_seed(123, "a") != derive_seed(123, "b")


def test_nested_output_path_is_accepted_when_extension_matches():
    (item,) = parse_manifest([{"id": "x", "speaker_id": "s", "text": "t", "output": "ch1/line_001.wav"}])
    assert item.output == "ch1/line_001.wav"


def test_every_problem_is_reported_at_once():
    data = [
        {"id": "ok", "speaker_id": "s", "text": "fine"},
        {"id": "e1", "speaker_id": "s", "text": "   "},
        {"id": "ok", "speaker_id": "s", "text": "dup"},
        {"id": "../evil", "speaker_id": "s", "text": "t"},
        {"id": "o1", "speaker_id": "s", "text": "t", "output": "../escape.wav"},
        {"id": "o2", "speaker_id": "s", "text": "t", "output": "/abs/path.wav"},
        {"id": "o3", "speaker_id": "s", "text": "t", "format": "wav", "output": "x.flac"},
        {"id": "f1", "speaker_id": "s", "text": "t", "format": "aiff"},
        {"id": "k1", "speaker_id": "s", "text": "t", "options": {"temprature": 1.0}},
        {"id": "k2", "speaker_id": "s", "text": "t", "options": {"top_p": 1.5, "top_k": True}},
        {"id": "s1", "text": "no speaker"},
        {"id": "x1", "speaker_id": "s", "text": "t", "speaker": "typo"},
        {"id": "n1", "speaker_id": "s", "text": "t", "seed": -1},
        "not an object",
    ]
    problems = problems_of(data)
    joined = "\n".join(problems)
    assert len(problems) == 14, joined
    assert "'text' is empty" in joined
    assert "duplicate id (first used by item 0)" in joined
    assert "'id' must be a name" in joined
    assert "unsafe output name '../escape.wav'" in joined
    assert "unsafe output name '/abs/path.wav'" in joined
    assert "does not end in .wav" in joined
    assert "format 'aiff' is not one of" in joined
    assert "unknown option 'temprature'" in joined
    assert "option 'top_p' must be a number in (0, 1]" in joined
    assert "option 'top_k' must be an integer >= 0, got True" in joined
    assert "'speaker_id' is missing" in joined
    assert "unknown key(s) ['speaker']" in joined
    assert "'seed' must be an integer from 0 to 4294967295 (the HTTP API's range), got -1" in joined
    assert "item 13: must be an object" in joined


def test_speakers_and_languages_are_checked_beside_every_other_problem():
    """An item's unknown voice and language come with its other problems, not in a second round once those are
    fixed (they were: only items without structural problems reached the speaker and language checks)."""
    data = [
        {"id": "a", "speaker_id": "carol", "text": "", "language": "klingon", "seed": 2**32},
        {"id": "b", "speaker_id": "alice", "text": "fine", "language": "xx", "options": {"top_k": -1}},
        {"id": "c", "speaker_id": "alice", "text": "fine", "language": "de"},
    ]
    problems = problems_of(data, speakers={"alice"}, languages=["auto", "english", "german"])
    assert problems == [
        "item 0 ('a'): unknown speaker_id 'carol'",
        "item 0 ('a'): 'text' is empty",
        "item 0 ('a'): unknown language 'klingon' (known: Auto, English (en), German (de); a name in any case or "
        "its ISO 639-1 code)",
        "item 0 ('a'): 'seed' must be an integer from 0 to 4294967295 (the HTTP API's range), got 4294967296",
        "item 1 ('b'): unknown language 'xx' (known: Auto, English (en), German (de); a name in any case or its "
        "ISO 639-1 code)",
        "item 1 ('b'): option 'top_k' must be an integer >= 0, got -1",
    ]


@pytest.mark.parametrize(
    ("given", "name"),
    [("en", "english"), ("EN", "english"), ("en-US", "english"), ("pt_BR", "portuguese"), ("zh", "chinese"),
     ("ja", "japanese"), ("ko", "korean"), ("de", "german"), ("fr", "french"), ("ru", "russian"), ("es", "spanish"),
     ("it", "italian"), ("German", "german"), ("auto", "auto")],
)  # fmt: skip
def test_iso_639_1_codes_map_onto_the_model_language_names(given: str, name: str):
    data = {"defaults": {"language": given}, "items": [{"id": "a", "speaker_id": "s", "text": "t"}]}
    (item,) = parse_manifest(data, languages=["auto", *sorted(ISO_639_1.values())])
    assert item.language == name


def test_derived_seeds_are_within_the_http_seed_range():
    seeds = [derive_seed(base, f"item{i}") for base in (0, 1, 2**40) for i in range(200)]
    assert all(0 <= s <= MAX_SEED for s in seeds) and len(set(seeds)) == len(seeds)


def test_the_seed_manifest_needs_no_id_it_comes_from_the_output():
    # The seed README's example, as written: no `id`, a capitalised language, an output file per item.
    seed_example = [
        {"speaker_id": "alice", "text": "First.", "language": "English", "output": "a.wav"},
        {"speaker_id": "bob", "text": "Second.", "language": "English", "output": "b.wav"},
    ]
    a, b = parse_manifest(seed_example, base_seed=1)
    assert (a.id, a.speaker_id, a.text, a.language, a.output, a.format) == (
        "a",
        "alice",
        "First.",
        "english",
        "a.wav",
        "wav",
    )
    assert (b.id, b.output) == ("b", "b.wav")
    assert a.seed == derive_seed(1, "a")


def test_derived_ids_and_formats_follow_the_output():
    data = [
        {"speaker_id": "s", "text": "t", "output": "ch1/003.mp3"},
        {"speaker_id": "s", "text": "t", "output": "x.flac"},
        {"id": "given", "speaker_id": "s", "text": "t", "output": "y.wav"},
    ]
    nested, flac, given = parse_manifest(data, default_format="ogg")
    assert (nested.id, nested.format, nested.output) == ("ch1.003", "mp3", "ch1/003.mp3")
    assert (flac.id, flac.format) == ("x", "flac")
    assert given.id == "given"


def test_items_without_id_or_usable_output_are_refused_with_the_reason():
    data = [
        {"speaker_id": "s", "text": "no id, no output"},
        {"speaker_id": "s", "text": "t", "output": "../up.wav"},
        {"speaker_id": "s", "text": "t", "output": "a.wav"},
        {"speaker_id": "s", "text": "t", "output": "a.flac"},  # derived id 'a' again
    ]
    joined = "\n".join(problems_of(data))
    assert "item 0: 'id' is missing (give an 'id', or an 'output' to derive it from)" in joined
    assert "item 1 ('...up'): no 'id', and output '../up.wav' gives no usable one" in joined
    assert "item 3 ('a'): duplicate id (first used by item 2)" in joined


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ([], "no items"),
        ({"items": "x"}, "expected a list of items"),
        (42, "expected a list of items"),
    ],
)
def test_malformed_manifest_shapes_are_refused(data, message):
    assert any(message in p for p in problems_of(data))


def test_unknown_top_level_and_default_keys_are_refused():
    data = {"items": [{"id": "a", "speaker_id": "s", "text": "t"}], "default": {}, "defaults": {"text": "x"}}
    joined = "\n".join(problems_of(data))
    assert "unknown top-level key(s) ['default']" in joined
    assert "defaults: unknown key(s) ['text']" in joined


def test_invalid_json_is_one_line_with_its_position(tmp_path: Path):
    p = tmp_path / "m.json"
    p.write_text('[{"id": "a",}]')
    with pytest.raises(ManifestError) as e:
        read_manifest(p)
    (line,) = e.value.problems
    assert "invalid JSON at line 1 column" in line


def test_missing_manifest_file_is_reported(tmp_path: Path):
    with pytest.raises(ManifestError) as e:
        read_manifest(tmp_path / "nope.json")
    assert "cannot read" in e.value.problems[0]


def test_read_manifest_round_trips_a_file(tmp_path: Path):
    p = tmp_path / "m.json"
    p.write_text(json.dumps({"items": [{"id": "a", "speaker_id": "s", "text": "héllo"}]}), encoding="utf-8")
    (item,) = read_manifest(p)
    assert item.text == "héllo"


def test_check_items_reports_unknown_speakers_languages_and_case_clashes(tmp_path: Path):
    items = parse_manifest(
        [
            {"id": "a", "speaker_id": "alice", "text": "t", "language": "english"},
            {"id": "b", "speaker_id": "carol", "text": "t"},
            {"id": "c", "speaker_id": "alice", "text": "t", "language": "klingon"},
            {"id": "d", "speaker_id": "alice", "text": "t", "output": "A.wav"},
        ]
    )
    problems = check_items(items, output_dir=tmp_path, speakers={"alice"}, languages=["auto", "english"])
    joined = "\n".join(problems)
    assert len(problems) == 3, joined
    assert "unknown speaker_id 'carol'" in joined
    assert "unknown language 'klingon'" in joined
    assert "output 'A.wav' is also the output of item 'a'" in joined


def test_output_through_a_symlink_that_leaves_the_output_dir_is_refused(tmp_path: Path):
    out = tmp_path / "out"
    out.mkdir()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (out / "link").symlink_to(elsewhere, target_is_directory=True)
    assert resolve_output(out, "link/x.wav") is None
    assert resolve_output(out, "sub/x.wav") == (out / "sub" / "x.wav").resolve()
    items = parse_manifest([{"id": "a", "speaker_id": "s", "text": "t", "output": "link/a.wav"}])
    (problem,) = check_items(items, output_dir=out, speakers={"s"})
    assert "resolves outside the output directory" in problem
