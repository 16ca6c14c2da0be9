"""extract_speaker_embedding.py on the tiny random checkpoint: clips of any rate, channel count and format in,
validated voice profiles out; every refusal (duration, silence, clipping, names, overwrite) has a test."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
import torch
from media_helpers import ffmpeg_clip

from qwen_tts import icl_profile
from qwen_tts.model.codec_encoder import load_codec_encoder
from qwen_tts.voices import ClipAudio, ClipRefused, ProfileError, check_clip, load_clip, load_profile, sha256_file
from tts_tools import extract
from tts_tools.extract import collect_jobs

REPO = Path(__file__).resolve().parent.parent


def speechlike(seconds: float, sr: int, f0: float = 140.0, amp: float = 0.3, seed: int = 0) -> np.ndarray:
    """Harmonics of a wobbling f0, gated at a syllable rate, plus a little noise: level statistics like speech."""
    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * sr)) / sr
    pitch = f0 * (1 + 0.08 * np.sin(2 * np.pi * 0.7 * t))
    phase = 2 * np.pi * np.cumsum(pitch) / sr
    voiced = sum(np.sin(k * phase) / k for k in range(1, 8))
    gate = 0.5 + 0.5 * np.sin(2 * np.pi * 4.0 * t) ** 2
    x = voiced * gate + 0.02 * rng.standard_normal(t.size)
    return (amp * x / np.max(np.abs(x))).astype(np.float32)


def write_clip(path: Path, x: np.ndarray, sr: int, channels: int = 1) -> Path:
    data = np.stack([x] * channels, axis=1) if channels > 1 else x
    path.parent.mkdir(parents=True, exist_ok=True)
    sf.write(str(path), data, sr)
    return path


@pytest.fixture(scope="module")
def tiny_model(tiny_checkpoint: Path) -> Path:
    return tiny_checkpoint


@pytest.fixture(scope="module")
def model_dim(tiny_model: Path) -> int:
    from qwen_tts.model.config import ModelConfig

    return ModelConfig.from_pretrained(tiny_model).xvector_dim


def run(tiny_model: Path, out: Path, *args: str) -> int:
    return extract.main(["--model", str(tiny_model), "--output-dir", str(out), "--device", "cpu", *args])


# ---------------------------------------------------------------------------------------------- level checks


def test_check_clip_measures_a_good_clip():
    x = speechlike(6.0, 24000)
    levels = check_clip(ClipAudio.from_samples(x, 24000), "a.wav")
    assert levels.seconds == pytest.approx(6.0)
    assert levels.warnings == []
    assert levels.peak == pytest.approx(0.3, rel=1e-4)
    assert -30 < levels.rms_dbfs < -10
    assert levels.clipped_fraction == 0.0


@pytest.mark.parametrize(
    ("seconds", "amp", "message"),
    [
        (0.5, 0.3, "a.wav: too short (0.50 s; a reference clip needs at least 1 s)"),
        (61.0, 0.3, "a.wav: too long (61.0 s; the limit is 60 s"),
        (6.0, 1e-4, "a.wav: silent or nearly (RMS -"),
    ],
)
def test_check_clip_refuses_with_one_line_naming_file_and_value(seconds, amp, message):
    x = speechlike(seconds, 8000, amp=amp)
    with pytest.raises(ClipRefused) as e:
        check_clip(ClipAudio.from_samples(x, 8000), "a.wav")
    assert str(e.value).startswith(message)
    assert "\n" not in str(e.value)


def test_check_clip_refuses_heavy_clipping_and_accepts_a_few_peaks_at_full_scale():
    x = np.clip(speechlike(6.0, 24000, amp=3.0), -1.0, 1.0)
    with pytest.raises(ClipRefused, match=r"heavily clipped \(\d+\.\d% of samples at full scale"):
        check_clip(ClipAudio.from_samples(x, 24000), "c.wav")
    y = speechlike(6.0, 24000, amp=1.0)  # normalized to exactly full scale: a handful of samples touch it
    assert check_clip(ClipAudio.from_samples(y, 24000), "n.wav").clipped_fraction < 0.01


def test_check_clip_warns_outside_the_recommended_duration():
    x = speechlike(3.0, 24000)
    levels = check_clip(ClipAudio.from_samples(x, 24000), "short.wav")
    assert levels.warnings == ["short.wav: 3.0 s is outside the recommended 5-30 s"]


@pytest.mark.parametrize(
    ("ext", "sr", "channels"), [("wav", 44100, 2), ("flac", 48000, 6), ("ogg", 48000, 2), ("mp3", 22050, 2)]
)
def test_load_clip_in_blocks_gives_the_numbers_of_reading_the_file_whole(tmp_path, ext, sr, channels):
    """Decoded in blocks mixed to mono as they come, a clip measures and embeds exactly as the whole (N, C) read,
    mixed and resampled (the model's input path) did: the same mono bits, the same clipped fraction and levels."""
    from qwen_tts.audio import load_audio
    from qwen_tts.voices import CLIP_LEVEL

    x = np.stack([speechlike(6.0, sr, amp=1.0 - 0.1 * c, seed=c) for c in range(channels)], axis=1)
    path = tmp_path / f"clip.{ext}"
    sf.write(str(path), x, sr)
    clip = load_clip(path)
    samples, rate = load_audio(path)  # the whole file, as enrollment read it before
    whole = ClipAudio.from_samples(samples, rate)
    assert (clip.frames, clip.sample_rate, clip.channels) == (samples.shape[0], rate, channels)
    np.testing.assert_array_equal(clip.mono, whole.mono)
    assert clip.clipped == whole.clipped > 0
    assert clip.clipped_fraction == float(np.mean(np.abs(samples) >= CLIP_LEVEL))
    assert check_clip(clip, "c") == check_clip(whole, "c")


# ---------------------------------------------------------------------------------------------- clip sources


def test_collect_jobs_from_folder_list_and_single_file(tmp_path: Path):
    d = tmp_path / "clips"
    write_clip(d / "b_voice.wav", speechlike(1.5, 8000), 8000)
    write_clip(d / "a_voice.flac", speechlike(1.5, 8000), 8000)
    (d / "a_voice.txt").write_text("Transcript of A.\n")
    (d / "notes.md").write_text("ignored")
    jobs = collect_jobs([d])
    assert [(j.name, j.ref_text) for j in jobs] == [("a_voice", "Transcript of A."), ("b_voice", "")]

    lst = tmp_path / "voices.txt"
    lst.write_text("# comment\nclips/a_voice.flac|anna|Hello there.\n\nclips/b_voice.wav\n")
    jobs = collect_jobs([lst])
    assert [(j.audio, j.name, j.ref_text) for j in jobs] == [
        (tmp_path / "clips/a_voice.flac", "anna", "Hello there."),
        (tmp_path / "clips/b_voice.wav", "b_voice", ""),
    ]
    (job,) = collect_jobs([d / "b_voice.wav"], output_name="bee", ref_text="Hi.")
    assert (job.name, job.ref_text) == ("bee", "Hi.")


def test_audio_is_told_from_list_files_by_extension_then_content(tmp_path: Path):
    memo = tmp_path / "memo.m4a"
    memo.write_bytes(ffmpeg_clip(speechlike(1.5, 16000), 16000, "m4a"))
    odd = tmp_path / "memo.recording"  # an extension of neither kind: the content decides
    odd.write_bytes(memo.read_bytes())
    assert [(j.audio, j.name) for j in collect_jobs([memo])] == [(memo, "memo")]
    assert [(j.audio, j.name) for j in collect_jobs([odd])] == [(odd, "memo")]
    listed = tmp_path / "clips.csv"  # text under another extension: a list file
    listed.write_text("memo.m4a|ann\n")
    assert [(j.audio, j.name) for j in collect_jobs([listed])] == [(memo, "ann")]
    folder = tmp_path / "folder"
    folder.mkdir()
    (folder / "a.webm").write_bytes(ffmpeg_clip(speechlike(1.5, 16000), 16000, "webm"))
    (folder / "b.aac").write_bytes(ffmpeg_clip(speechlike(1.5, 16000), 16000, "aac"))
    assert [j.name for j in collect_jobs([folder])] == ["a", "b"]


def test_a_file_that_is_neither_audio_nor_a_list_says_which_it_was_taken_for(tmp_path: Path):
    blob = tmp_path / "clip.xyz"
    blob.write_bytes(bytes(range(256)) * 4)
    with pytest.raises(extract.CliError) as e:
        collect_jobs([blob])
    assert str(e.value).startswith(
        f"{blob}: read as a list file (its content is not audio) but it is not UTF-8 text; a clip needs an audio "
        "extension (.wav, .flac, .ogg, .oga, .opus, .mp3, .m4a,"
    )
    assert "codec" not in str(e.value)
    bad_list = tmp_path / "voices.txt"
    bad_list.write_bytes(b"\xff\xfe clip.wav")
    with pytest.raises(extract.CliError, match=r"voices\.txt: read as a list file \(its extension '\.txt' names"):
        collect_jobs([bad_list])


def test_output_name_with_several_clips_is_refused(tmp_path: Path):
    write_clip(tmp_path / "a.wav", speechlike(1.5, 8000), 8000)
    write_clip(tmp_path / "b.wav", speechlike(1.5, 8000), 8000)
    with pytest.raises(extract.CliError, match="--output-name and --ref-text apply to one clip"):
        collect_jobs([tmp_path / "a.wav", tmp_path / "b.wav"], output_name="x")


def test_missing_source_is_refused(tmp_path: Path):
    with pytest.raises(extract.CliError, match="no such file or folder"):
        collect_jobs([tmp_path / "nope.wav"])


# ---------------------------------------------------------------------------------------------- end to end


def test_a_clip_without_a_transcript_is_an_x_vector_voice_and_loads_no_codec_encoder(
    tiny_model, tmp_path, monkeypatch, capsys
):
    def refuse(model_path, device="cpu"):
        raise AssertionError("an x-vector voice needs no codec encoder")

    monkeypatch.setattr(icl_profile, "load_reference_encoder", refuse)
    clip = write_clip(tmp_path / "plain.wav", speechlike(6.0, 24000), 24000)
    assert run(tiny_model, tmp_path / "p", "--ref-audio", str(clip), "--no-progress") == 0
    assert load_profile(tmp_path / "p" / "plain.safetensors").ref_codes is None
    assert "x-vector only" in capsys.readouterr().out


def test_icl_enrolment_refuses_a_clip_longer_than_a_reference_and_a_transcript_without_words(
    tiny_model, tmp_path, capsys
):
    long_clip = write_clip(tmp_path / "long.wav", speechlike(31.0, 16000), 16000)
    out = tmp_path / "p"
    assert run(tiny_model, out, "--ref-audio", str(long_clip), "--ref-text", "Many words.", "--no-progress") == 1
    err = capsys.readouterr().err
    assert f"{long_clip}: 31.0 s is longer than an ICL reference may be (30 s)" in err
    assert run(tiny_model, out, "--ref-audio", str(long_clip), "--no-progress") == 0  # as an x-vector voice: fine
    short = write_clip(tmp_path / "short.wav", speechlike(6.0, 16000), 16000)
    assert run(tiny_model, out, "--ref-audio", str(short), "--ref-text", "?!", "--no-progress") == 1
    assert f"{short}: reference text: the transcript has no letters or digits" in capsys.readouterr().err
    assert not (out / "short.safetensors").exists()


def test_an_icl_voice_needs_the_codec_encoder_and_says_so_in_one_line(tiny_model, tmp_path, monkeypatch, capsys):
    def missing(model_path, device="cpu"):
        raise FileNotFoundError("no speech tokenizer encoder weights")

    monkeypatch.setattr(icl_profile, "load_reference_encoder", missing)
    clip = write_clip(tmp_path / "v.wav", speechlike(6.0, 24000), 24000)
    assert run(tiny_model, tmp_path / "p", "--ref-audio", str(clip), "--ref-text", "Words.", "--no-progress") == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"error: cannot load the codec encoder from {str(tiny_model)!r} for an ICL voice: no speech "
                   "tokenizer encoder weights"]  # fmt: skip


@pytest.mark.parametrize(
    ("name", "sr", "channels"),
    [("v44k_stereo.wav", 44100, 2), ("v16k.flac", 16000, 1), ("v48k.ogg", 48000, 2), ("v22k.mp3", 22050, 1)],
)
def test_extracts_a_profile_from_any_rate_channels_and_format(tiny_model, model_dim, tmp_path, name, sr, channels):
    clip = write_clip(tmp_path / name, speechlike(6.0, sr, seed=sr), sr, channels)
    out = tmp_path / "profiles"
    assert run(tiny_model, out, "--ref-audio", str(clip), "--ref-text", "Some words.", "--no-progress") == 0
    profile = load_profile(out / f"{clip.stem}.safetensors", expected_dim=model_dim)
    assert profile.dim == model_dim
    assert profile.ref_text == "Some words."
    # --ref-text: an ICL voice, its codes the codec encoder's on the clip's mono 24 kHz signal.
    codes = load_codec_encoder(tiny_model).encode(load_clip(clip).mono, 24000)
    assert torch.equal(profile.ref_codes, codes) and profile.ref_codes.shape[0] == 75
    assert profile.source_sha256 == sha256_file(clip)
    assert profile.source_seconds == pytest.approx(6.0, abs=0.06)  # mp3 adds encoder padding
    assert profile.model == f"{tiny_model.name} [tiny]"
    assert torch.isfinite(profile.x_vector).all() and profile.x_vector.abs().max() > 0


def test_a_phone_m4a_is_enrolled_like_its_wav(tiny_model, model_dim, tmp_path):
    x = speechlike(6.0, 44100, seed=5)
    memo = tmp_path / "memo.m4a"
    memo.write_bytes(ffmpeg_clip(np.stack([x, x], axis=1), 44100, "m4a"))
    write_clip(tmp_path / "same.wav", x, 44100)
    write_clip(tmp_path / "other.wav", speechlike(6.0, 44100, f0=95.0, seed=1), 44100)
    out = tmp_path / "profiles"
    clips = [str(memo), str(tmp_path / "same.wav"), str(tmp_path / "other.wav")]
    assert run(tiny_model, out, "--ref-audio", *clips, "--no-progress") == 0
    profile = load_profile(out / "memo.safetensors", expected_dim=model_dim)
    assert profile.source_sha256 == sha256_file(memo)
    assert profile.source_seconds == pytest.approx(6.0, abs=0.05)  # AAC priming and padding: under 50 ms
    same, other = (load_profile(out / f"{n}.safetensors").x_vector for n in ("same", "other"))

    def distance(a: torch.Tensor, b: torch.Tensor) -> float:
        return 1.0 - float(torch.nn.functional.cosine_similarity(a, b, dim=0))

    # AAC of the same speech lands next to its WAV, far closer than another voice does (the random tiny encoder
    # puts every voice near the others, so the comparison is relative).
    assert distance(profile.x_vector, same) < 0.1 * distance(other, same)


def test_stereo_with_equal_channels_gives_the_mono_xvector(tiny_model, tmp_path):
    x = speechlike(6.0, 32000, seed=3)
    write_clip(tmp_path / "mono.wav", x, 32000)
    write_clip(tmp_path / "stereo.wav", x, 32000, channels=2)
    out = tmp_path / "p"
    assert run(tiny_model, out, "--ref-audio", str(tmp_path / "mono.wav"), str(tmp_path / "stereo.wav")) == 0
    a = load_profile(out / "mono.safetensors").x_vector
    b = load_profile(out / "stereo.safetensors").x_vector
    torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_different_voices_give_different_xvectors(tiny_model, tmp_path):
    write_clip(tmp_path / "low.wav", speechlike(6.0, 24000, f0=95.0, seed=1), 24000)
    write_clip(tmp_path / "high.wav", speechlike(6.0, 24000, f0=230.0, seed=2), 24000)
    out = tmp_path / "p"
    assert run(tiny_model, out, "--ref-audio", str(tmp_path), "--no-progress") == 0
    a = load_profile(out / "low.safetensors").x_vector
    b = load_profile(out / "high.safetensors").x_vector
    assert not torch.allclose(a, b, atol=1e-3)


def test_profile_width_is_enforced_by_the_shared_reader(tiny_model, model_dim, tmp_path):
    clip = write_clip(tmp_path / "v.wav", speechlike(6.0, 24000), 24000)
    assert run(tiny_model, tmp_path / "p", "--ref-audio", str(clip)) == 0
    with pytest.raises(ProfileError, match=f"width {model_dim}, the loaded model needs {2 * model_dim}"):
        load_profile(tmp_path / "p" / "v.safetensors", expected_dim=2 * model_dim)


def test_existing_profile_is_kept_unless_force(tiny_model, tmp_path, capsys):
    clip = write_clip(tmp_path / "v.wav", speechlike(6.0, 24000), 24000)
    out = tmp_path / "p"
    assert run(tiny_model, out, "--ref-audio", str(clip), "--output-name", "me") == 0
    before = (out / "me.safetensors").read_bytes()
    capsys.readouterr()
    write_clip(clip, speechlike(6.0, 24000, f0=200.0), 24000)
    assert run(tiny_model, out, "--ref-audio", str(clip), "--output-name", "me") == 1
    assert capsys.readouterr().err.strip() == f"error: {out / 'me.safetensors'} exists (use --force to overwrite)"
    assert (out / "me.safetensors").read_bytes() == before
    assert run(tiny_model, out, "--ref-audio", str(clip), "--output-name", "me", "--force") == 0
    assert (out / "me.safetensors").read_bytes() != before
    assert [p.name for p in out.iterdir()] == ["me.safetensors"]  # no temp files left


@pytest.mark.parametrize(
    ("seconds", "sr", "amp", "clip_it", "expected"),
    [
        (0.6, 16000, 0.3, False, "too short (0.60 s"),
        (61.0, 8000, 0.3, False, "too long (61.0 s"),
        (6.0, 16000, 0.0, False, "silent or nearly"),
        (6.0, 16000, 4.0, True, "heavily clipped"),
    ],
)
def test_refused_clip_writes_nothing_and_exits_1(tiny_model, tmp_path, capsys, seconds, sr, amp, clip_it, expected):
    x = speechlike(seconds, sr) * (amp / 0.3)
    clip = write_clip(tmp_path / "bad.wav", np.clip(x, -1, 1) if clip_it else x, sr)
    out = tmp_path / "p"
    assert run(tiny_model, out, "--ref-audio", str(clip)) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[0].startswith(f"error: {clip}: {expected}")
    assert err[-1] == "error: 1 of 1 clip(s) not enrolled"
    assert not any(out.glob("*")) if out.exists() else True


def test_unreadable_audio_is_one_line(tiny_model, tmp_path, capsys):
    clip = tmp_path / "fake.wav"
    clip.write_bytes(b"RIFF not really a wave file")
    assert run(tiny_model, tmp_path / "p", "--ref-audio", str(clip)) == 1
    err = capsys.readouterr().err
    assert f"error: {clip}: cannot decode 'fake.wav' as audio (not one of WAV" in err
    assert "Traceback" not in err


def test_one_refused_clip_does_not_stop_the_others(tiny_model, tmp_path, capsys):
    d = tmp_path / "clips"
    write_clip(d / "good.wav", speechlike(6.0, 24000), 24000)
    write_clip(d / "tiny.wav", speechlike(0.3, 24000), 24000)
    out = tmp_path / "p"
    assert run(tiny_model, out, "--ref-audio", str(d)) == 1
    assert sorted(p.name for p in out.iterdir()) == ["good.safetensors"]
    assert "error: 1 of 2 clip(s) not enrolled" in capsys.readouterr().err


def test_bad_names_and_clashes_are_all_reported_before_loading(tmp_path, capsys):
    d = tmp_path / "clips"
    write_clip(d / "ok.wav", speechlike(1.5, 8000), 8000)
    write_clip(d / "OK.flac", speechlike(1.5, 8000), 8000)
    write_clip(d / "-bad name.wav", speechlike(1.5, 8000), 8000)
    out = tmp_path / "p"
    out.mkdir()
    (out / "ok.safetensors").write_bytes(b"x")
    # A model that does not exist proves nothing was loaded: the name problems come first.
    rc = extract.main(["--model", str(tmp_path / "no-model"), "--output-dir", str(out), "--ref-audio", str(d)])
    assert rc == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 3, err
    assert any("'-bad name' is not a valid voice name" in line for line in err)
    assert any(f"voice name 'ok' is also used by {d / 'OK.flac'}" in line for line in err)
    assert f"error: {out / 'ok.safetensors'} exists (use --force to overwrite)" in err


def test_bad_model_is_one_line(tmp_path, capsys):
    clip = write_clip(tmp_path / "v.wav", speechlike(6.0, 24000), 24000)
    rc = extract.main(["--model", str(tmp_path / "no-model"), "--output-dir", str(tmp_path), "--ref-audio", str(clip)])
    assert rc == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: --model '{tmp_path / 'no-model'}'")


def test_script_help_and_a_real_run_as_subprocess(tiny_model, tmp_path):
    r = subprocess.run(
        [sys.executable, "extract_speaker_embedding.py", "--help"], cwd=REPO, capture_output=True, text=True, timeout=60
    )
    assert r.returncode == 0
    for flag in ("--model", "--device", "--ref-audio", "--ref-text", "--output-name", "--output-dir", "--force"):
        assert flag in r.stdout
    clip = write_clip(tmp_path / "in put.ogg", speechlike(6.0, 48000), 48000, channels=2)
    out = tmp_path / "profiles"
    args = ["--model", str(tiny_model), "--ref-audio", str(clip), "--output-name", "sub", "--output-dir", str(out)]
    r = subprocess.run(
        [sys.executable, "extract_speaker_embedding.py", *args], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith(f"wrote {out / 'sub.safetensors'} (6.0 s of audio")
    assert load_profile(out / "sub.safetensors").dim > 0


@pytest.mark.parametrize("seconds", [200.0, 61.0])
def test_a_long_clip_is_refused_from_its_header_without_decoding(tmp_path, monkeypatch, seconds):
    clip = tmp_path / "podcast.wav"
    sf.write(str(clip), np.zeros(int(seconds * 8000), np.int16), 8000, subtype="PCM_16")

    def must_not_decode(*args, **kwargs):
        raise AssertionError("decoded a clip whose header already says it is too long")

    monkeypatch.setattr(sf.SoundFile, "read", must_not_decode)
    with pytest.raises(ClipRefused) as e:
        load_clip(clip)
    assert str(e.value) == f"{clip}: too long ({seconds:.1f} s; the limit is 60 s, trim it to 5-30 s)"


def test_a_clip_without_a_label_is_named_without_its_repr():
    import io

    with pytest.raises(ClipRefused) as e:
        load_clip(io.BytesIO(b"this is not audio at all" * 10))
    assert str(e.value).startswith("<stream>: cannot decode this file as audio (not one of WAV")
    assert str(e.value).endswith("; libsndfile: Format not recognised)")
