"""Offline batch synthesis: a manifest of (voice, text) items -> audio files plus a summary JSON.

Items run concurrently through the same `qwen_tts.engine_api.Engine` the server uses (continuous batching in the
native engine). The whole manifest and every voice profile are checked before the model loads; each output is
written atomically, so `--resume` can trust any file it finds; one failed item never stops the others.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np
import soundfile as sf
import torch
from tqdm import tqdm

from qwen_tts.engine_api import (
    MAX_SEED,
    SAMPLE_RATE,
    Engine,
    EngineSettings,
    EngineSettingsError,
    QueueFullError,
    SynthesisRequest,
)
from qwen_tts.engines import create_engine
from qwen_tts.icl import IclReference
from qwen_tts.voices import (
    DEFAULT_PROFILES_DIR,
    InvalidProfileError,
    SpeakerError,
    VoiceRegistry,
    atomic_write,
    profile_path,
)
from tts_server.cli import program_name

from .common import CliError, add_model_options
from .manifest import (
    AUDIO_FORMATS,
    ManifestError,
    ManifestItem,
    check_items,
    collect_items,
    load_json,
    referenced_speakers,
    resolve_output,
)

# soundfile (libsndfile) container and sample encoding per output format.
SOUNDFILE_FORMATS = {
    "wav": ("WAV", "PCM_16"),
    "flac": ("FLAC", "PCM_16"),
    "ogg": ("OGG", "VORBIS"),
    "mp3": ("MP3", "MPEG_LAYER_III"),
}
BACKENDS = ("native", "vllm-omni")
SUMMARY_NAME = "summary.json"
QUEUE_FULL_RETRY_S = 0.05
_ENGINE = EngineSettings()  # the engine's defaults
# BatchOptions field -> EngineSettings field: the one mapping (engine_settings() and error messages use it).
ENGINE_FIELDS = {
    "model": "model_path",
    "backend": "backend",
    "stage_configs_path": "backend_options.stage_config",  # the vllm-omni backend's own option
    "device": "device",
    "dtype": "dtype",
    "concurrency": "max_slots",
}
FLAGS = {"stage_configs_path": "--stage-configs-path"}  # where a flag is not the field name


@dataclass
class BatchOptions:
    manifest: Path
    profiles_dir: Path = DEFAULT_PROFILES_DIR
    output_dir: Path = Path("batch_output")
    model: str = _ENGINE.model_path
    device: str = _ENGINE.device
    dtype: str | None = _ENGINE.dtype
    backend: str = _ENGINE.backend
    stage_configs_path: Path | None = None
    concurrency: int = 8
    format: str = "wav"
    seed: int | None = None
    resume: bool = False
    summary_path: Path | None = None  # default: <output_dir>/summary.json
    progress: bool = True

    def engine_settings(self) -> EngineSettings:
        """What the engine is built from: the one mapping from these options to `EngineSettings`. Items in flight
        are capped at --concurrency, so that many slots and as many queue places suffice."""
        mapped = {engine: getattr(self, name) for name, engine in ENGINE_FIELDS.items()}
        options = {"stage_config": mapped.pop("backend_options.stage_config")}
        return EngineSettings(**mapped, max_queue=self.concurrency, backend_options=options)

    def describe_engine_setting(self, engine_field: str) -> str:
        """`--flag 'value'` for the option behind an EngineSettings field (for one-line errors)."""
        for name, engine in ENGINE_FIELDS.items():
            if engine == engine_field:
                return f"{FLAGS.get(name, '--' + name)} {str(getattr(self, name))!r}"
        return f"engine setting {engine_field}"


@dataclass
class ItemResult:
    id: str
    output: str
    speaker_id: str
    status: str  # ok | failed | skipped (finished by an earlier run)
    seed: int | None = None
    duration: float | None = None  # audio seconds in the file
    frames: int | None = None
    finish_reason: str | None = None
    wall_time: float | None = None
    time_to_first_audio: float | None = None
    voice_mode: str | None = None  # icl | xvector: how the voice was cloned
    error: str | None = None


@dataclass
class BatchPlan:
    items: list[ManifestItem]
    voices: dict[str, tuple[torch.Tensor, IclReference | None]]  # x-vector and ICL reference of each voice
    targets: dict[str, Path]  # item id -> absolute output path
    skipped: list[ItemResult] = field(default_factory=list)

    @property
    def todo(self) -> list[ManifestItem]:
        done = {r.id for r in self.skipped}
        return [it for it in self.items if it.id not in done]


def _load_voices(
    speaker_ids: set[str], profiles_dir: Path, xvector_dim: int
) -> tuple[dict[str, tuple[torch.Tensor, IclReference | None]], set[str], list[str]]:
    """(usable voices, ids that have a profile file, problems); a wrong-width profile is a problem, not a skip."""
    registry = VoiceRegistry(profiles_dir, xvector_dim=xvector_dim)
    voices: dict[str, tuple[torch.Tensor, IclReference | None]] = {}
    present: set[str] = set()
    problems = []
    for sid in sorted(speaker_ids):
        try:
            voices[sid] = registry.voice(sid)
            present.add(sid)
        except InvalidProfileError as e:
            present.add(sid)
            problems.append(f"voice {sid!r} ({profile_path(profiles_dir, sid)}): {e.reason}")
        except SpeakerError:
            continue  # reported once per item by check_items as an unknown speaker
    return voices, present, problems


def _finished_output(path: Path) -> float | None:
    """Audio seconds of a complete earlier output, or None. Outputs are renamed into place only when whole."""
    try:
        info = sf.info(str(path))
    except (sf.LibsndfileError, RuntimeError, OSError):
        return None
    return info.frames / info.samplerate if info.frames > 0 else None


def _previous_results(summary_path: Path) -> dict[str, dict[str, Any]]:
    try:
        data = json.loads(summary_path.read_text(encoding="utf-8"))
        return {r["id"]: r for r in data.get("items", []) if r.get("status") in ("ok", "skipped")}
    except (OSError, ValueError, AttributeError, KeyError, TypeError):
        return {}


def plan_batch(opts: BatchOptions, *, xvector_dim: int, languages: Sequence[str] | None) -> BatchPlan:
    """Validate the manifest and voices as a whole, in one pass; raises ManifestError with every problem found.

    The voices every item names are loaded first (those of items with other problems too), so each item is checked
    against them and the engine's languages beside its other problems: fixing one round never uncovers another."""
    data = load_json(opts.manifest)
    voices, present, voice_problems = _load_voices(referenced_speakers(data), opts.profiles_dir, xvector_dim)
    items, problems = collect_items(
        data, default_format=opts.format, base_seed=opts.seed, speakers=present, languages=languages
    )
    problems += check_items(items, output_dir=opts.output_dir, speakers=present)
    problems += voice_problems
    problems += [
        f"item {it.index} ({it.id!r}): voice_mode 'icl' needs a voice with ICL data, and speaker_id "
        f"{it.speaker_id!r} has none (enrol it with --ref-text); use 'auto' or 'xvector'"
        for it in items
        if it.voice_mode == "icl" and it.speaker_id in voices and voices[it.speaker_id][1] is None
    ]
    if problems:
        raise ManifestError(problems)
    targets = {it.id: resolve_output(opts.output_dir, it.output) for it in items}
    plan = BatchPlan(items=items, voices=voices, targets=targets)
    if opts.resume:
        previous = _previous_results(opts.summary_path or opts.output_dir / SUMMARY_NAME)
        for it in items:
            seconds = _finished_output(targets[it.id])
            if seconds is None:
                continue
            old = previous.get(it.id, {})
            plan.skipped.append(
                ItemResult(
                    id=it.id,
                    output=it.output,
                    speaker_id=it.speaker_id,
                    status="skipped",
                    seed=it.seed if it.seed is not None else old.get("seed"),
                    duration=round(seconds, 4),
                    frames=old.get("frames"),
                    finish_reason=old.get("finish_reason"),
                    wall_time=old.get("wall_time"),
                    voice_mode=old.get("voice_mode"),
                )
            )
    return plan


def write_audio_atomic(path: Path, audio: np.ndarray, fmt: str, sample_rate: int = SAMPLE_RATE) -> None:
    """Encode into a temp file beside the target, then rename: a reader never sees a partial file."""
    container, subtype = SOUNDFILE_FORMATS[fmt]
    clipped = np.clip(audio, -1.0, 1.0)
    atomic_write(path, lambda tmp: sf.write(tmp, clipped, sample_rate, subtype=subtype, format=container))


def write_json_atomic(path: Path, data: Any) -> None:
    def write(tmp: str) -> None:
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(data, f, indent=2, ensure_ascii=False)
            f.write("\n")

    atomic_write(path, write)


def _request(item: ManifestItem, voice: tuple[torch.Tensor, IclReference | None]) -> SynthesisRequest:
    """The engine request of an item: its voice in ICL mode where the voice has ICL data, unless it asks for
    'xvector' (plan_batch refused 'icl' for a voice without)."""
    xvector, icl = voice
    return SynthesisRequest(
        text=item.text,
        xvector=xvector,
        icl=None if item.voice_mode == "xvector" else icl,
        language=item.language,
        seed=item.seed,
        request_id=f"batch-{item.id}",
        **item.options,
    )


async def _submit(engine: Engine, req: SynthesisRequest):
    # Concurrency is capped below the engine's capacity, but another caller may share the engine: wait, don't fail.
    while True:
        try:
            return engine.submit(req)
        except QueueFullError:
            await asyncio.sleep(QUEUE_FULL_RETRY_S)


async def _run_item(engine: Engine, plan: BatchPlan, item: ManifestItem) -> ItemResult:
    result = ItemResult(id=item.id, output=item.output, speaker_id=item.speaker_id, status="failed", seed=item.seed)
    handle = None
    try:
        request = _request(item, plan.voices[item.speaker_id])
        result.voice_mode = "icl" if request.icl is not None else "xvector"
        handle = await _submit(engine, request)
        audio = await handle.collect()
        if audio.size == 0:
            raise RuntimeError("the engine returned no audio")
        rate = engine.sample_rate
        await asyncio.to_thread(write_audio_atomic, plan.targets[item.id], audio, item.format, rate)
        result.status = "ok"
        result.duration = round(audio.shape[0] / rate, 4)
    except Exception as e:  # one bad item is reported and the batch goes on
        result.error = f"{type(e).__name__}: {e}"
    if handle is not None:
        st = handle.stats
        result.frames = st.frames
        result.finish_reason = st.finish_reason.value if st.finish_reason else None
        result.wall_time = None if st.wall_time is None else round(st.wall_time, 4)
        ttfa = st.time_to_first_audio
        result.time_to_first_audio = None if ttfa is None else round(ttfa, 4)
        if result.seed is None:
            # The engine drew one (engine_api.draw_seed, within the HTTP API's range): recorded, the item can be
            # replayed by the batch tool or over HTTP.
            result.seed = handle.request.seed
    return result


async def run_plan(engine: Engine, plan: BatchPlan, *, concurrency: int, progress: bool = True) -> list[ItemResult]:
    """Run every item not yet done, at most `concurrency` at a time, with a progress bar; results in manifest order."""
    todo = plan.todo
    sem = asyncio.Semaphore(concurrency)
    audio_s = 0.0
    t0 = time.monotonic()
    bar = tqdm(
        total=len(plan.items),
        initial=len(plan.items) - len(todo),
        desc="items",
        unit="item",
        file=sys.stderr,
        disable=not progress,
    )

    async def one(item: ManifestItem) -> ItemResult:
        nonlocal audio_s
        async with sem:
            r = await _run_item(engine, plan, item)
        if r.error:
            tqdm.write(f"error: item {item.id!r}: {r.error}", file=sys.stderr)
        audio_s += r.duration or 0.0
        elapsed = max(time.monotonic() - t0, 1e-9)
        bar.set_postfix_str(f"audio={audio_s:.1f}s, {audio_s / elapsed:.2f} audio-s/s")
        bar.update(1)
        return r

    try:
        done = await asyncio.gather(*(one(it) for it in todo))
    finally:
        bar.close()
    by_id = {r.id: r for r in [*plan.skipped, *done]}
    return [by_id[it.id] for it in plan.items]


def summarize(opts: BatchOptions, results: list[ItemResult], *, started_at: str, wall_time: float) -> dict[str, Any]:
    ran = [r for r in results if r.status != "skipped"]
    audio = sum(r.duration or 0.0 for r in ran if r.status == "ok")
    return {
        "manifest": str(opts.manifest),
        "model": opts.model,
        "backend": opts.backend,
        "started_at": started_at,
        "wall_time": round(wall_time, 3),
        "totals": {
            "items": len(results),
            "ok": sum(r.status == "ok" for r in results),
            "failed": sum(r.status == "failed" for r in results),
            "skipped": sum(r.status == "skipped" for r in results),
            "audio_seconds": round(audio, 3),
            "audio_seconds_per_second": round(audio / wall_time, 3) if wall_time > 0 else None,
            "voice_modes": {mode: sum(r.voice_mode == mode for r in ran) for mode in ("icl", "xvector")},
        },
        "items": [asdict(r) for r in results],
    }


def _create_engine(opts: BatchOptions) -> Engine:
    """The engine the options describe (not started: only the model's config is read)."""
    try:
        return create_engine(opts.engine_settings())
    except EngineSettingsError as e:  # no such model, no CUDA, a backend this build lacks: one line
        raise CliError(f"{opts.describe_engine_setting(e.setting)}: {e}") from None


def run_batch(opts: BatchOptions, engine: Engine | None = None) -> dict[str, Any]:
    """Validate, run and summarize a batch; returns the summary (also written to disk).

    `engine` (not started) replaces the one built from the options. Raises ManifestError (every problem) or
    CliError (one line) on bad input.
    """
    problems = []  # every bad option at once
    if opts.concurrency < 1:
        problems.append(f"--concurrency must be >= 1, got {opts.concurrency}")
    if opts.format not in AUDIO_FORMATS:
        problems.append(f"--format must be one of {', '.join(AUDIO_FORMATS)}")
    if opts.backend not in BACKENDS:
        problems.append(f"--backend must be one of {', '.join(BACKENDS)}")
    if opts.stage_configs_path is not None and not opts.stage_configs_path.is_file():
        problems.append(f"--stage-configs-path {opts.stage_configs_path}: no such file")
    if opts.seed is not None and not 0 <= opts.seed <= MAX_SEED:
        problems.append(f"--seed must be from 0 to {MAX_SEED} (the HTTP API's seed range), got {opts.seed}")
    if problems:
        raise CliError("\n".join(problems))
    engine = engine or _create_engine(opts)
    plan = plan_batch(opts, xvector_dim=engine.xvector_dim, languages=engine.languages)
    summary_path = opts.summary_path or opts.output_dir / SUMMARY_NAME
    started_at = datetime.now(timezone.utc).isoformat(timespec="seconds")
    t0 = time.monotonic()
    results = asyncio.run(_serve(engine, plan, opts)) if plan.todo else [*plan.skipped]
    summary = summarize(opts, results, started_at=started_at, wall_time=time.monotonic() - t0)
    write_json_atomic(summary_path, summary)
    return summary


async def _serve(engine: Engine, plan: BatchPlan, opts: BatchOptions) -> list[ItemResult]:
    try:
        await engine.start()
    except Exception as e:  # weights that do not load, no memory: one line, nothing was run
        await engine.stop()
        raise CliError(f"the engine did not start ({type(e).__name__}: {e}); nothing was run") from None
    try:
        return await run_plan(engine, plan, concurrency=opts.concurrency, progress=opts.progress)
    finally:
        await engine.stop()


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=program_name("qwen3-tts-batch"),  # qwen3-tts-batch, batch_inference.py, python -m ...: as it was run
        description=(
            "Synthesize every item of a JSON manifest with enrolled voices, concurrently, through the same "
            "engine as the server. The whole manifest is checked first and every problem is listed at once."
        ),
        epilog=(
            'Manifest: a list of items, or {"defaults": {...}, "items": [...]}; an item has speaker_id, '
            "text and optionally id (default: from output), language, seed, format, output, options. "
            f"A summary JSON is written to <output-dir>/{SUMMARY_NAME}. "
            "Exit status: 0 all items written, 1 bad input or any item failed."
        ),
    )
    p.add_argument("--manifest", required=True, type=Path, help="manifest JSON file")
    d = BatchOptions  # the defaults, as class attributes
    p.add_argument("--profiles-dir", type=Path, default=d.profiles_dir, help="voice profiles folder")
    p.add_argument("--output-dir", type=Path, default=d.output_dir, help="where audio files go")
    add_model_options(p, model=d.model, device=d.device)
    p.add_argument("--dtype", default=d.dtype, help="float32 | bfloat16 (default: bfloat16 on CUDA, float32 on CPU)")
    p.add_argument(
        "--backend",
        choices=BACKENDS,
        default=None,
        help="engine implementation (default: native; vllm-omni when --stage-configs-path is given). "
        "vllm-omni needs vllm, vllm-omni and vllm-omni-myfi installed (see README).",
    )
    p.add_argument(
        "--stage-configs-path",
        type=Path,
        default=None,
        help="vLLM-Omni deploy config YAML (implies --backend vllm-omni; default for that backend: "
        "stage_config_optimized.yaml)",
    )
    p.add_argument(
        "--concurrency", type=int, default=d.concurrency, help=f"items in flight at once (default: {d.concurrency})"
    )
    p.add_argument(
        "--format", choices=AUDIO_FORMATS, default=d.format, help="format of items without one (default wav)"
    )
    p.add_argument("--seed", type=int, default=None, help="base seed: items without a seed get one derived from it")
    p.add_argument("--resume", action="store_true", help="skip items whose output file already exists")
    p.add_argument(
        "--summary",
        dest="summary_path",
        metavar="SUMMARY",
        type=Path,
        default=None,
        help=f"summary path (default: <output-dir>/{SUMMARY_NAME})",
    )
    p.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")
    return p


def options_from_args(args: argparse.Namespace) -> BatchOptions:
    """The parser's destinations are BatchOptions' fields; only the backend is derived when not given."""
    fields = dict(vars(args))
    fields["backend"] = args.backend or ("vllm-omni" if args.stage_configs_path else BatchOptions.backend)
    return BatchOptions(**fields)


def main(argv: Sequence[str] | None = None, engine: Engine | None = None) -> int:
    opts = options_from_args(build_parser().parse_args(argv))
    try:
        summary = run_batch(opts, engine)
    except ManifestError as e:
        for line in e.problems:
            print(f"error: {line}", file=sys.stderr)
        print(f"error: {len(e.problems)} problem(s) in the manifest or voices; nothing was run", file=sys.stderr)
        return 1
    except CliError as e:
        for line in str(e).splitlines():
            print(f"error: {line}", file=sys.stderr)
        return 1
    t = summary["totals"]
    line = (
        f"{t['ok']} ok, {t['failed']} failed, {t['skipped']} skipped; {t['audio_seconds']:.1f} s of audio "
        f"in {summary['wall_time']:.1f} s; summary: {opts.summary_path or opts.output_dir / SUMMARY_NAME}"
    )
    print(line, file=sys.stderr if t["failed"] else sys.stdout)
    return 1 if t["failed"] else 0
