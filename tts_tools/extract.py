"""Voice enrollment: reference clips -> voice profiles (`voice_profiles/<name>.safetensors`).

Runs the ECAPA-TDNN speaker encoder (qwen-tts 0.1.1 `extract_speaker_embedding`, reimplemented in
`qwen_tts.model.speaker_encoder`), loaded alone from the checkpoint. A clip given with its transcript (`--ref-text`,
a `<stem>.txt` beside it, or a list file's third column) becomes an ICL voice: the checkpoint's codec encoder, loaded
on first need, turns the clip into its reference codes once, here, and the profile keeps them with the transcript.
Profiles use the shared format and directory rules of `qwen_tts.voices`, which the server's voice registry reads;
that format records the model and the x-vector width, so a profile made with one model size is refused by a server
running the other.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from qwen_tts import icl_profile
from qwen_tts.audio import ACCEPTED_FORMATS, sniff_format
from qwen_tts.model.model_paths import DEMO
from qwen_tts.voices import (
    DEFAULT_PROFILES_DIR,
    ClipLevels,
    ClipRefused,
    VoiceEncoder,
    VoiceProfile,
    enroll_clip,
    is_valid_speaker_id,
    profile_path,
    save_profile,
    sha256_file,
)
from tts_server.cli import program_name

from .common import CliError, add_model_options, model_label, resolve_device, resolve_model

# A file given with one of these extensions is a clip; with one of LIST_EXTENSIONS, a list file; with any other,
# its first bytes decide (`qwen_tts.audio.sniff_format`: a known audio container is a clip, UTF-8 text a list file).
# What a clip really is, and so how it is decoded, always comes from its content.
AUDIO_EXTENSIONS = (
    ".wav", ".flac", ".ogg", ".oga", ".opus", ".mp3", ".m4a", ".mp4", ".aac", ".webm", ".weba", ".mka", ".amr",
)  # fmt: skip
LIST_EXTENSIONS = (".txt", ".list", ".lst")
LIST_SEPARATOR = "|"
_SNIFF_BYTES = 64

# The clip checks (duration, silence, clipping) and their limits live in qwen_tts.voices, shared with the server's
# upload route: MIN_CLIP_SECONDS, MAX_CLIP_SECONDS, RECOMMENDED_SECONDS, SILENCE_RMS_DBFS, MAX_CLIPPED_FRACTION.


@dataclass(frozen=True)
class ClipJob:
    audio: Path
    name: str
    ref_text: str = ""


def _jobs_from_list(list_file: Path) -> list[ClipJob]:
    """`audio_path|name|ref_text` per line (name and text optional); relative paths are from the list's folder."""
    jobs = []
    why = (
        f"its extension {list_file.suffix.lower()!r} names a list file"
        if list_file.suffix.lower() in LIST_EXTENSIONS
        else "its content is not audio"
    )
    try:
        lines = list_file.read_text(encoding="utf-8").splitlines()
    except OSError as e:
        raise CliError(f"{list_file}: cannot read it as a list file ({e.strerror or e})") from None
    except UnicodeDecodeError:
        raise CliError(
            f"{list_file}: read as a list file ({why}) but it is not UTF-8 text; a clip needs an audio extension "
            f"({', '.join(AUDIO_EXTENSIONS)}) or audio content ({ACCEPTED_FORMATS})"
        ) from None
    for line in lines:
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        parts = [p.strip() for p in line.split(LIST_SEPARATOR, 2)]
        audio = Path(parts[0])
        if not audio.is_absolute():
            audio = list_file.parent / audio
        name = parts[1] if len(parts) > 1 and parts[1] else audio.stem
        jobs.append(ClipJob(audio, name, parts[2] if len(parts) > 2 else ""))
    return jobs


def _jobs_from_dir(folder: Path) -> list[ClipJob]:
    """Every audio file in the folder (not recursive); `<stem>.txt` beside a clip is its reference text."""
    jobs = []
    for audio in sorted(p for p in folder.iterdir() if p.is_file() and p.suffix.lower() in AUDIO_EXTENSIONS):
        sidecar = audio.with_suffix(".txt")
        ref_text = sidecar.read_text(encoding="utf-8").strip() if sidecar.is_file() else ""
        jobs.append(ClipJob(audio, audio.stem, ref_text))
    return jobs


def is_audio_file(path: Path) -> bool:
    """A clip (True) or a list file (False): by extension where it is one of AUDIO_EXTENSIONS or LIST_EXTENSIONS,
    else by content (a known audio container's first bytes make a clip)."""
    suffix = path.suffix.lower()
    if suffix in AUDIO_EXTENSIONS:
        return True
    if suffix in LIST_EXTENSIONS:
        return False
    try:
        with open(path, "rb") as f:
            head = f.read(_SNIFF_BYTES)
    except OSError as e:
        raise CliError(f"{path}: cannot read ({e.strerror or e})") from None
    return sniff_format(head) is not None


def collect_jobs(sources: Sequence[str | Path], output_name: str | None = None, ref_text: str = "") -> list[ClipJob]:
    """Expand files, folders and list files into clip jobs. Raises CliError on unusable sources."""
    jobs: list[ClipJob] = []
    single = len(sources) == 1
    for src in map(Path, sources):
        if src.is_dir():
            found = _jobs_from_dir(src)
            if not found:
                raise CliError(f"{src}: no audio files ({', '.join(AUDIO_EXTENSIONS)}) in this folder")
            jobs += found
            single = False
        elif src.is_file() and is_audio_file(src):
            jobs.append(ClipJob(src, src.stem, ref_text))
        elif src.is_file():
            jobs += _jobs_from_list(src)
            single = False
        else:
            raise CliError(f"{src}: no such file or folder")
    if not jobs:
        raise CliError("no reference clips given")
    if output_name is not None or ref_text:
        if not single or len(jobs) != 1:
            raise CliError(
                "--output-name and --ref-text apply to one clip; with several, names come from the file stems "
                "(or the list file) and texts from <stem>.txt files (or the list file)"
            )
        jobs[0] = ClipJob(jobs[0].audio, output_name or jobs[0].name, ref_text)
    return jobs


def plan_problems(jobs: Sequence[ClipJob], output_dir: Path, force: bool) -> list[str]:
    """Every reason not to start: bad or duplicate names, existing profiles without --force."""
    problems = []
    seen: dict[str, Path] = {}
    for job in jobs:
        if not is_valid_speaker_id(job.name):
            problems.append(
                f"{job.audio}: {job.name!r} is not a valid voice name (letters, digits, '_', '.', '-', "
                "up to 64, starting with a letter or digit); pass --output-name or rename the file"
            )
            continue
        target = profile_path(output_dir, job.name)
        if target.exists() and not force:
            problems.append(f"{target} exists (use --force to overwrite)")
        # Case-folded: on a case-insensitive filesystem 'Ann' and 'ann' would be one file.
        key = job.name.casefold()
        if key in seen:
            problems.append(f"{job.audio}: voice name {job.name!r} is also used by {seen[key]}")
        else:
            seen[key] = job.audio
    return problems


@dataclass
class ClipResult:
    job: ClipJob
    profile: Path | None = None
    error: str | None = None
    levels: ClipLevels | None = None
    ref_frames: int = 0  # an ICL voice's reference codec frames


def extract_voices(
    jobs: Sequence[ClipJob],
    *,
    model: str,
    output_dir: str | Path = DEFAULT_PROFILES_DIR,
    device: str = "auto",
    force: bool = False,
    progress: bool = True,
) -> list[ClipResult]:
    """Enroll every clip; a refused clip is reported in its result and the others go on."""
    output_dir = Path(output_dir)
    problems = plan_problems(jobs, output_dir, force)
    if problems:
        raise CliError("\n".join(problems))
    model_path = resolve_model(model)
    dev = resolve_device(device)
    try:
        encoder = VoiceEncoder(model_path, device=dev)
    except Exception as e:  # a wrong folder or a checkpoint without a speaker encoder: one line, no traceback
        raise CliError(f"cannot load the speaker encoder from {model!r}: {e}") from None
    label = model_label(model, model_path, encoder.config)
    codec: list[icl_profile.ReferenceEncoder] = []

    def reference_encoder() -> icl_profile.ReferenceEncoder:
        """The codec encoder, loaded for the first clip with a transcript (x-vector voices never need it)."""
        if not codec:
            try:
                codec.append(icl_profile.load_reference_encoder(model_path, device=dev))
            except Exception as e:  # a checkpoint without the speech tokenizer's encoder: one line
                raise CliError(f"cannot load the codec encoder from {model!r} for an ICL voice: {e}") from None
        return codec[0]

    results = []
    bar = tqdm(jobs, desc="voices", unit="clip", disable=not progress or len(jobs) < 2, file=sys.stderr)
    for job in bar:
        bar.set_postfix_str(job.name)
        result = ClipResult(job)
        results.append(result)
        try:
            enrolled = enroll_clip(encoder, job.audio, ref_text=job.ref_text, reference_encoder=reference_encoder)
            result.levels = enrolled.levels
            for w in result.levels.warnings:
                tqdm.write(f"warning: {w}", file=sys.stderr)
            profile = VoiceProfile(
                x_vector=enrolled.x_vector,
                model=label,
                source_sha256=sha256_file(job.audio),
                source_seconds=result.levels.seconds,
                ref_text=enrolled.ref_text,
                ref_codes=enrolled.ref_codes,
            )
            result.ref_frames = 0 if enrolled.ref_codes is None else int(enrolled.ref_codes.shape[0])
            result.profile = save_profile(profile_path(output_dir, job.name), profile, overwrite=force)
        except CliError:
            raise
        except (ClipRefused, FileExistsError) as e:
            result.error = str(e)
        except icl_profile.IclDataError as e:
            result.error = f"{job.audio}: reference text: {e}"
        except Exception as e:  # keep going with the other clips; name the clip and the failure
            result.error = f"{job.audio}: failed ({type(e).__name__}: {e})"
    return results


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=program_name(
            "qwen3-tts-extract"
        ),  # qwen3-tts-extract, extract_speaker_embedding.py, python -m ...: as it was run
        description=(
            "Enroll voices: compute the speaker x-vector of reference clips (wav/flac/ogg/opus/mp3, and through "
            "FFmpeg m4a/mp4 (AAC, ALAC), aac, webm, amr; any rate and "
            "channel count; 5-30 s of clean speech is best) and write voice profiles that the server and "
            "the batch tool load by name. Only the speaker encoder is loaded from the checkpoint."
        ),
        epilog=(
            "Several clips: pass a folder (every audio file; <stem>.txt beside a clip is its transcript, which makes "
            "an ICL voice) or "
            f"a list file with lines 'audio_path{LIST_SEPARATOR}name{LIST_SEPARATOR}ref_text' (name and text "
            f"optional). A file is a clip if its extension is an audio one ({' '.join(AUDIO_EXTENSIONS)}), a list "
            f"file if it is {' '.join(LIST_EXTENSIONS)}, else whatever its content is. "
            "Exit status: 0 all written, 1 any clip refused or failed or bad arguments."
        ),
    )
    add_model_options(p, model=DEMO, device="auto")
    p.add_argument(
        "--ref-audio", required=True, nargs="+", metavar="PATH", help="audio file(s), folder(s) or list file(s)"
    )
    p.add_argument(
        "--ref-text",
        default="",
        help="transcript of the clip: makes an ICL voice (its codec codes are computed once, here; the clip at most "
        f"{icl_profile.MAX_REF_SECONDS:g} s)",
    )
    p.add_argument("--output-name", default=None, help="voice name for a single clip (default: the file stem)")
    p.add_argument(
        "--output-dir", default=str(DEFAULT_PROFILES_DIR), help="where profiles go (default: voice_profiles)"
    )
    p.add_argument("--force", action="store_true", help="overwrite existing profiles")
    p.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    options = vars(build_parser().parse_args(argv))
    try:
        jobs = collect_jobs(options.pop("ref_audio"), options.pop("output_name"), options.pop("ref_text"))
        results = extract_voices(jobs, **options)  # the other destinations are its keyword arguments
    except CliError as e:
        for line in str(e).splitlines():
            print(f"error: {line}", file=sys.stderr)
        return 1
    failed = 0
    for r in results:
        if r.error:
            failed += 1
            print(f"error: {r.error}", file=sys.stderr)
        else:
            kind = f", ICL: {r.ref_frames} reference frames" if r.ref_frames else ", x-vector only"
            print(f"wrote {r.profile} ({r.levels.seconds:.1f} s of audio, {r.levels.rms_dbfs:.1f} dBFS RMS{kind})")
    if failed:
        print(f"error: {failed} of {len(results)} clip(s) not enrolled", file=sys.stderr)
    return 1 if failed else 0
