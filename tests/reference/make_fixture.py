"""Record what the official qwen-tts 0.1.1 computes on our random checkpoints: the parity fixture and a full-size check.

Runs in the reference venv (.venv-ref, see README.md), never in ours. Our checkpoint writer (and, for --size, our
loader and generate loop) is imported from this repository first; both packages are called `qwen_tts`, so our modules
are imported, kept, and taken out of sys.modules before the official package is imported.

    .venv-ref/bin/python tests/reference/make_fixture.py --out tests/reference/fixture_tiny.pt
    .venv-ref/bin/python tests/reference/make_fixture.py --size 1.7b --device cuda --frames 16

Tiny mode writes the tiny checkpoint (seed 0) with our writer, loads it with `Qwen3TTSModel.from_pretrained`
(float32, eager attention), asserts that the official state_dicts have exactly the tensors our writer wrote (names,
shapes, values), and saves: text-tokenizer ids, prefill / trailing / tpad embeddings and greedy codes (EOS held off)
for several texts, languages and both text modes, talker logits for a teacher-forced sequence, code-predictor logits
for a teacher-forced frame, a Code2Wav waveform for fixed codes, and the mel and x-vector of a synthetic clip.
`tests/test_parity.py` compares our implementation against it with the .venv only.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib
import importlib.machinery
import importlib.metadata
import sys
import tempfile
import time
import types
from pathlib import Path

import numpy as np
import torch
from torch import nn

REPO = Path(__file__).resolve().parents[2]
SR = 24000

TEXTS = [
    "Hello world, the quick brown fox.",
    "Grüße aus Köln, sagte die Stimme.",
    "你好，世界。这是一个测试。",
    "Café naïve Cafe\u0301 résumé",  # the decomposed é must be NFC-normalised
    "Numbers 12345, symbols #@! and 3.14",
    "  leading spaces\nnew line\ttab  ",
    "Emoji 🙂 and ümlauts",
    "a",
]
# (text index, language, non_streaming, x-vector source)
CASES = [
    (0, "english", True, "clip"),
    (0, "english", False, "clip"),
    (1, "german", True, "clip"),
    (2, "chinese", False, "clip"),
    (4, "auto", True, "randn"),
    (6, "auto", False, "clip"),
    (7, "french", False, "randn"),
]
FRAMES = 32


def stub_missing_modules() -> None:
    """torchaudio, sox and onnxruntime (the 25 Hz tokenizer's) are imported by the package but unused on the 12 Hz
    path (reference doc section 9)."""
    for group in (("torchaudio", "torchaudio.compliance", "torchaudio.compliance.kaldi"), ("sox",), ("onnxruntime",)):
        try:
            importlib.import_module(group[0])
        except Exception:
            for name in group:
                module = types.ModuleType(name)
                module.__spec__ = importlib.machinery.ModuleSpec(name, None)
                sys.modules[name] = module


_OURS: dict[str, types.ModuleType] = {}  # our qwen_tts modules, kept after they leave sys.modules


def import_ours(names: list[str]) -> types.SimpleNamespace:
    """Import qwen_tts.<name> from this repository (each under its last dotted part: "model.loading" as `loading`),
    then hide the repository package from later imports."""
    sys.path.insert(0, str(REPO))
    try:
        mods = {n.rsplit(".", 1)[-1]: importlib.import_module(f"qwen_tts.{n}") for n in names}
    finally:
        sys.path.remove(str(REPO))
        for key in [k for k in sys.modules if k == "qwen_tts" or k.startswith("qwen_tts.")]:
            _OURS[key] = sys.modules.pop(key)
    return types.SimpleNamespace(**mods)


@contextlib.contextmanager
def ours_active():
    """Our modules back in sys.modules for code of ours that imports lazily (e.g. qwen_tts.fastpath.fused)."""
    theirs = {k: sys.modules.pop(k) for k in list(sys.modules) if k == "qwen_tts" or k.startswith("qwen_tts.")}
    sys.modules.update(_OURS)
    try:
        yield
    finally:
        for key in _OURS:
            sys.modules.pop(key, None)
        sys.modules.update(theirs)


def import_official() -> types.SimpleNamespace:
    stub_missing_modules()
    import qwen_tts
    from qwen_tts import Qwen3TTSModel
    from qwen_tts.core.models.modeling_qwen3_tts import mel_spectrogram

    if Path(qwen_tts.__file__).resolve().parent == REPO / "qwen_tts":
        raise SystemExit("imported this repository's qwen_tts instead of the official package")
    return types.SimpleNamespace(Qwen3TTSModel=Qwen3TTSModel, mel_spectrogram=mel_spectrogram)


def synthetic_clip(seconds: float = 2.5) -> np.ndarray:
    """A voiced-sounding deterministic clip: harmonics of a vibrato f0, syllable envelope, a little noise."""
    rng = np.random.default_rng(1234)
    t = np.arange(int(seconds * SR)) / SR
    f0 = 140.0 * (1 + 0.05 * np.sin(2 * np.pi * 5 * t))
    phase = 2 * np.pi * np.cumsum(f0) / SR
    voiced = sum(np.sin(k * phase) / k for k in range(1, 9))
    envelope = 0.55 + 0.45 * np.sin(2 * np.pi * 3 * t)
    wav = voiced * envelope + 0.05 * rng.standard_normal(t.shape)
    return (0.5 * wav / np.abs(wav).max()).astype(np.float32)


def tensors_of(file: Path) -> dict[str, torch.Tensor]:
    from safetensors import safe_open

    with safe_open(str(file), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (safe_open is not iterable)


def check_official_state_dicts(tts, ckpt: Path, values: bool = True) -> None:
    """The official modules hold exactly the tensors in the files: same names, shapes (and values)."""
    pairs = [
        (tts.model.state_dict(), tensors_of(ckpt / "model.safetensors"), "model.safetensors"),
        (
            tts.model.speech_tokenizer.model.state_dict(),
            tensors_of(ckpt / "speech_tokenizer/model.safetensors"),
            "speech_tokenizer/model.safetensors",
        ),
    ]
    for official, ours, name in pairs:
        missing, extra = sorted(set(official) - set(ours)), sorted(set(ours) - set(official))
        bad = [k for k in official if k in ours and tuple(official[k].shape) != tuple(ours[k].shape)]
        if missing or extra or bad:
            raise SystemExit(f"{name}: official-only {missing[:5]}, file-only {extra[:5]}, shape mismatch {bad[:5]}")
        if values:
            differ = [k for k in official if not torch.equal(official[k].cpu(), ours[k].to(official[k].dtype))]
            if differ:
                raise SystemExit(f"{name}: the official loader changed {differ[:5]}")
        print(f"{name}: {len(official)} tensors, names and shapes equal to the official state_dict")


@contextlib.contextmanager
def capture_talker(tts, frames: int):
    """Hold EOS off for the whole run (min_new_tokens) and capture the talker's prefill inputs."""
    talker = tts.model.talker
    original = talker.generate
    seen: dict[str, torch.Tensor] = {}

    def generate(*args, **kwargs):
        seen.update(
            prefill=kwargs["inputs_embeds"][0].detach().float().cpu(),
            trailing=kwargs["trailing_text_hidden"][0].detach().float().cpu(),
            pad=kwargs["tts_pad_embed"].reshape(-1).detach().float().cpu(),
        )
        kwargs["min_new_tokens"] = frames + 1
        return original(*args, **kwargs)

    talker.generate = generate
    try:
        yield seen
    finally:
        talker.generate = original


def greedy_frames(frames: int) -> dict:
    """The official generation's arguments for `frames` greedy frames, called under `capture_talker(tts, frames)`
    (which holds EOS off): one token more, as the last sampled token gets no residual codes."""
    return {"max_new_tokens": frames + 1, "do_sample": False, "subtalker_dosample": False}


def official_ids(tts, text: str) -> list[int]:
    return tts.processor(text=tts._build_assistant_text(text), return_tensors="pt")["input_ids"][0].tolist()


def official_codes(tts, text: str, language: str, non_streaming: bool, xvector: torch.Tensor, frames: int):
    """Greedy codes (frames, 16) for batch 1, plus the captured prefill/trailing/tpad."""
    device = tts.model.talker.device
    ids = torch.tensor([official_ids(tts, text)], device=device)
    prompt = dict(ref_code=[None], ref_spk_embedding=[xvector], x_vector_only_mode=[True], icl_mode=[False])
    with capture_talker(tts, frames) as seen:
        codes, _ = tts.model.generate(
            input_ids=[ids],
            voice_clone_prompt=prompt,
            languages=[language],
            non_streaming_mode=non_streaming,
            **greedy_frames(frames),
        )
    return codes[0].cpu(), seen


def record_cases(tts, specs: list[tuple[int, str, bool, str]], xvectors: dict[str, torch.Tensor]) -> list[dict]:
    device = tts.model.talker.device
    cases = []
    for text_index, language, non_streaming, source in specs:
        codes, seen = official_codes(
            tts, TEXTS[text_index], language, non_streaming, xvectors[source].to(device), FRAMES
        )
        assert codes.shape == (FRAMES, 16), f"EOS was not held off: {tuple(codes.shape)}"
        cases.append(
            dict(
                text=TEXTS[text_index],
                language=language,
                non_streaming=non_streaming,
                xvector=xvectors[source],
                codes=codes,
                **seen,
            )
        )
    return cases


def record_code_predictor(tts, hidden: torch.Tensor, cb0: int) -> dict:
    """Logits of the 15 residual codes for one frame (greedy, so each step feeds back the argmax)."""
    talker = tts.model.talker
    h = hidden.reshape(1, 1, -1).to(talker.device)
    cb = torch.tensor([[cb0]], device=talker.device)
    result = talker.code_predictor.generate(
        inputs_embeds=torch.cat((h, talker.get_input_embeddings()(cb)), dim=1),
        max_new_tokens=15,
        do_sample=False,
        output_logits=True,
        return_dict_in_generate=True,
    )
    return {
        "hidden": hidden.float().cpu(),
        "cb0": cb0,
        "codes": result.sequences[0].cpu(),
        "logits": torch.cat(result.logits).float().cpu(),  # (15, vocab)
    }


def load_official(
    off, ckpt: Path, device: str, dtype: torch.dtype = torch.float32, values: bool = True, attn: str = "eager"
):
    tts = off.Qwen3TTSModel.from_pretrained(str(ckpt), dtype=dtype, attn_implementation=attn, device_map=device)
    check_official_state_dicts(tts, ckpt, values=values)
    return tts


def write_tiny(ours, seed: int, prefix: str) -> Path:
    """Our writer's tiny checkpoint (`seed`) in a new temporary folder."""
    work = Path(tempfile.mkdtemp(prefix=prefix))
    return ours.random_checkpoint.write_random_checkpoint(work / "tiny", size="tiny", seed=seed)


def tiny_meta(ours, ckpt: Path, seed: int, **more) -> dict:
    """What a tiny fixture records of its making: the checkpoint (size, seed, the writer's weights digest, which the
    tests check first) and the versions, then `more`."""
    return {
        "size": "tiny",
        "seed": seed,
        "weights_digest": ours.random_checkpoint.weights_digest(ckpt),
        "qwen_tts": importlib.metadata.version("qwen-tts"),
        "transformers": importlib.metadata.version("transformers"),
        "torch": str(torch.__version__),
        **more,
    }


def save_fixture(fx: dict, out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    torch.save(fx, out)
    print(f"wrote {out} ({out.stat().st_size / 1e6:.2f} MB), weights digest {fx['meta']['weights_digest'][:16]}")


def last_hidden(tts, prefill: torch.Tensor) -> torch.Tensor:
    talker = tts.model.talker
    return talker.model(inputs_embeds=prefill[None].to(talker.device), use_cache=False).last_hidden_state[0, -1]


@torch.inference_mode()
def record_tiny(out: Path, seed: int, device: str) -> None:
    ours = import_ours(["model.random_checkpoint"])
    off = import_official()
    ckpt = write_tiny(ours, seed, "qwen_tts_fixture_")
    tts = load_official(off, ckpt, device)
    model, talker = tts.model, tts.model.talker
    hidden = talker.config.hidden_size

    fx: dict = {
        "meta": tiny_meta(ours, ckpt, seed, device=device, frames=FRAMES),
        "texts": TEXTS,
        "chat_ids": [official_ids(tts, t) for t in TEXTS],
    }

    wav = synthetic_clip()
    mel = off.mel_spectrogram(
        torch.from_numpy(wav)[None],
        n_fft=1024,
        num_mels=128,
        sampling_rate=SR,
        hop_size=256,
        win_size=1024,
        fmin=0,
        fmax=12000,
    ).transpose(1, 2)
    item = tts.create_voice_clone_prompt(ref_audio=(wav, SR), x_vector_only_mode=True)[0]
    fx["speaker"] = {
        "wav": torch.from_numpy(wav),
        "mel": mel[0].float(),
        "xvector": item.ref_spk_embedding.float().cpu(),
        "xvector_from_mel": model.speaker_encoder(mel.to(model.device))[0].float().cpu(),
    }

    randn = torch.randn(hidden, generator=torch.Generator().manual_seed(7))
    cases = record_cases(tts, CASES, {"clip": fx["speaker"]["xvector"], "randn": randn})
    fx["cases"] = cases

    # Talker logits, teacher forced: case 0's prefill followed by 8 fixed random input rows, one full forward.
    g = torch.Generator().manual_seed(11)
    seq = torch.cat((cases[0]["prefill"], torch.randn(8, hidden, generator=g)))
    h = talker.model(inputs_embeds=seq[None].to(device), use_cache=False).last_hidden_state
    fx["talker"] = {"inputs": seq, "hidden": h[0].float().cpu(), "logits": talker.codec_head(h)[0].float().cpu()}
    fx["code_predictor"] = record_code_predictor(tts, h[0, len(cases[0]["prefill"]) - 1], int(cases[0]["codes"][0, 0]))

    codes = torch.randint(0, 2048, (2, 16, 12), generator=torch.Generator().manual_seed(5))
    decoder = model.speech_tokenizer.model.decoder
    fx["code2wav"] = {"codes": codes, "wav": decoder(codes.to(device))[:, 0].float().cpu()}

    # tiny-mtp: the code predictor behind a small_to_mtp_projection, as in 1.7B.
    mtp_ckpt = ours.random_checkpoint.write_random_checkpoint(ckpt.parent / "tiny-mtp", size="tiny-mtp", seed=seed)
    mtp = load_official(off, mtp_ckpt, device)
    mtp_cases = record_cases(mtp, CASES[:2], {"randn": randn, "clip": randn})
    fx["mtp"] = {
        "size": "tiny-mtp",
        "weights_digest": ours.random_checkpoint.weights_digest(mtp_ckpt),
        "cases": mtp_cases,
        "code_predictor": record_code_predictor(
            mtp, last_hidden(mtp, mtp_cases[0]["prefill"]), int(mtp_cases[0]["codes"][0, 0])
        ),
    }

    save_fixture(fx, out)


@torch.inference_mode()
def compare_full_size(size: str, device: str, frames: int, dtype: torch.dtype, workdir: Path, seed: int) -> None:
    """One short greedy generation through the official package and through ours on a full-size random checkpoint."""
    # cuDNN may use TF32 for convolutions by default; both sides would round differently (seen: 8.5e-4 on Code2Wav).
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_tf32 = False
    ours = import_ours(["model.random_checkpoint", "model.loading", "model.reference_loop"])
    off = import_official()
    ckpt = workdir / f"random-{size}-seed{seed}"
    t0 = time.time()
    if not (ckpt / "speech_tokenizer/model.safetensors").is_file():
        ours.random_checkpoint.write_random_checkpoint(ckpt, size=size, seed=seed)
        print(f"wrote {ckpt} in {time.time() - t0:.0f}s")
    tts = load_official(off, ckpt, device, dtype, values=False)
    mine = ours.loading.load_model(ckpt, device=device, dtype=dtype)
    hidden = mine.config.talker.hidden_size
    x = torch.randn(hidden, generator=torch.Generator().manual_seed(7)).to(device)
    all_equal = True
    for text_index, language, non_streaming, _ in CASES[:3]:
        text = TEXTS[text_index]
        ref_codes, seen = official_codes(tts, text, language, non_streaming, x.to(dtype), frames)
        our_codes = ours.reference_loop.generate_codes(
            mine.talker, mine.config, mine.tokenizer, text, x, language, non_streaming,
            max_frames=frames, min_new_tokens=frames,
        ).cpu()  # fmt: skip
        prefill = seen["prefill"].to(device=device, dtype=dtype)
        ref_logits = tts.model.talker.codec_head(
            tts.model.talker.model(inputs_embeds=prefill[None], use_cache=False).last_hidden_state
        )[0].float()
        cache = mine.talker.new_cache(1, len(prefill))
        positions = torch.arange(len(prefill), device=device)[None]
        slot = torch.zeros(1, dtype=torch.long, device=device)
        our_logits = mine.talker.logits(mine.talker(prefill[None], positions, cache, slot, len(prefill)))[0].float()
        diff = (ref_logits - our_logits).abs().max().item()
        same = ref_codes.shape == our_codes.shape and torch.equal(ref_codes, our_codes)
        all_equal &= same
        first = next((i for i in range(min(len(ref_codes), len(our_codes))) if not torch.equal(ref_codes[i], our_codes[i])), None)  # fmt: skip
        print(
            f"{size} {language:8s} non_streaming={non_streaming!s:5s} frames={len(ref_codes)}/{len(our_codes)} "
            f"codes identical={same} first differing frame={first} prefill logits max|diff|={diff:.3g}"
        )
    codes = ref_codes.T[None].to(device)  # (1, 16, T)
    ref_wav = tts.model.speech_tokenizer.model.decoder(codes)[:, 0].float()
    our_wav = mine.code2wav(codes)
    print(
        f"{size} Code2Wav on {codes.shape[-1]} frames: mean|wav| official {ref_wav.abs().mean().item():.3f} "
        f"ours {our_wav.abs().mean().item():.3f}, clipped {(ref_wav.abs() > 0.999).float().mean().item():.4f}, "
        f"max|diff| {(ref_wav - our_wav).abs().max().item():.3g}"
    )
    print("ALL CODES IDENTICAL" if all_equal else "CODES DIFFER")


def _teacher_inputs(ours, m32, frames: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """A teacher-forced sequence from our float32 model (equal to the official one in float32): the prompt of
    TEXTS[0] in English with a fixed random x-vector, then `frames` frames generated greedily (end-of-speech held
    off). -> (talker inputs (L + F - 1, H), code-predictor inputs (F, 15, H) = [C(cb0), E_0(cb1), ..., E_13(cb14)],
    codes (F, 16), prompt length L)."""
    cfg = m32.config
    tc = cfg.talker
    device = m32.talker.codec_head.weight.device
    x = torch.randn(tc.hidden_size, generator=torch.Generator().manual_seed(7)).to(device)
    text, language = TEXTS[0], "english"
    codes = ours.reference_loop.generate_codes(
        m32.talker, cfg, m32.tokenizer, text, x, language, True, max_frames=frames, min_new_tokens=frames
    )  # (F, 16)
    ids = m32.tokenizer.chat_ids(text)
    R, T_ = ours.tokenizer.ROLE_LEN, ours.tokenizer.TAIL_LEN
    prompt = ours.prompt.build_prompt(cfg, m32.talker, ids[R:-T_], ids[:R], x, language, True)
    cp_emb = m32.talker.code_predictor.model.codec_embedding
    c0 = m32.talker.embed_codec(codes[:, 0])  # (F, H)
    resid = [cp_emb[j](codes[:, j + 1]) for j in range(15)]  # each (F, H)
    track = torch.stack([prompt.trailing[k] if k < len(prompt.trailing) else prompt.pad for k in range(frames)])
    steps = c0 + torch.stack(resid).sum(0) + track  # input of the step after frame k
    seq = torch.cat((prompt.prefill, steps[:-1]))  # (L + F - 1, H)
    return seq, torch.stack([c0, *resid[:14]], dim=1), codes, prompt.prefill.shape[0]


# The bf16 free-running case: text, language, non_streaming; a seeded random x-vector; frames with EOS held off.
FREE_CASE = (0, "english", False)
FREE_FRAMES = 12


def official_free_running(tts, xvector: torch.Tensor, frames: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The official greedy generation, free running (its own codes fed back), EOS held off: codes (frames, 16) and
    the talker's input at each decode step (frames, H), captured where its decoder stack receives it."""
    inputs: list[torch.Tensor] = []

    def hook(_module, args, kwargs):
        x = kwargs.get("inputs_embeds")
        if x is not None and x.shape[1] == 1:  # a decode step (the prefill is the prompt)
            inputs.append(x[0, 0].detach().cpu())

    handle = tts.model.talker.model.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        text, language, non_streaming = FREE_CASE
        codes, _ = official_codes(tts, TEXTS[text], language, non_streaming, xvector, frames)
    finally:
        handle.remove()
    return codes, torch.stack(inputs[:frames])


@torch.inference_mode()
def record_tiny_bf16(out: Path, seed: int, frames: int = 8) -> None:
    """The bf16 parity fixture: for tiny and tiny-mtp, a teacher-forced sequence (`_teacher_inputs`) and the
    official package's bf16 logits on it as its generation computes them on the CPU (`_official_tf_incremental`,
    SDPA). `tests/test_parity.py` runs our bf16 model the engine's way on the same inputs against it. And the
    official bf16 greedy generation free running (`official_free_running`): its codes and each decode step's talker
    input, which our reference loop must reproduce bit for bit."""
    ours = import_ours(
        ["model.random_checkpoint", "model.loading", "model.reference_loop", "model.prompt", "model.tokenizer"]
    )
    off = import_official()
    work = Path(tempfile.mkdtemp(prefix="qwen_tts_fixture_bf16_"))
    fx: dict = {"meta": {"seed": seed, "frames": frames, "torch": str(torch.__version__), "attn": "sdpa"}}
    for size in ("tiny", "tiny-mtp"):
        ckpt = ours.random_checkpoint.write_random_checkpoint(work / size, size=size, seed=seed)
        m32 = ours.loading.load_model(ckpt, device="cpu", dtype=torch.float32)
        seq, cp_in, codes, L = _teacher_inputs(ours, m32, frames)
        V = m32.config.talker.codebook_size
        tts = load_official(off, ckpt, "cpu", torch.bfloat16, values=False, attn="sdpa")
        lo, co = _official_tf_incremental(tts, seq.bfloat16(), L, cp_in.bfloat16(), codes)
        top2 = torch.cat((lo[:, :V].flatten(0, -2), co.flatten(0, -2))).topk(2, dim=-1).values
        fx[size] = {
            "weights_digest": ours.random_checkpoint.weights_digest(ckpt),
            "inputs": seq.bfloat16(),
            "prefill_len": L,
            "codes": codes,
            "talker_logits": lo[:, :V].bfloat16(),  # computed in bf16: stored without loss
            "code_predictor_logits": co.bfloat16(),
        }
        xvector = torch.randn(m32.config.talker.hidden_size, generator=torch.Generator().manual_seed(seed + 7))
        free_codes, free_inputs = official_free_running(tts, xvector, FREE_FRAMES)
        text, language, non_streaming = FREE_CASE
        fx[size]["free_running"] = {
            "text": TEXTS[text], "language": language, "non_streaming": non_streaming, "xvector": xvector,
            "codes": free_codes, "talker_inputs": free_inputs,
        }  # fmt: skip
        gap = (top2[:, 0] - top2[:, 1]).min().item()
        print(f"{size}: L={L} frames={frames} talker {tuple(lo[:, :V].shape)} code predictor {tuple(co.shape)}; "
              f"smallest top-2 gap {gap:.4f}")  # fmt: skip
    torch.save(fx, out)
    print(f"wrote {out}")


def _ours_talker_tf(model, seq: torch.Tensor, prefill_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Our talker over a teacher-forced sequence (L + F - 1, H): the prompt as one prefill, then one token per step
    (the engine's order). -> (hidden, logits) at positions L-1 .. end."""
    talker = model.talker
    dev = seq.device
    n = len(seq)
    cache = talker.new_cache(1, n)
    slot = torch.zeros(1, dtype=torch.long, device=dev)
    hs = [talker(seq[None, :prefill_len], torch.arange(prefill_len, device=dev)[None], cache, slot, prefill_len)[0, -1]]
    for p in range(prefill_len, n):
        hs.append(talker(seq[None, p : p + 1], torch.full((1, 1), p, device=dev), cache, slot, p + 1)[0, -1])
    h = torch.stack(hs)
    return h, talker.logits(h).float()


def _ours_cp_tf(model, h: torch.Tensor, cp_in: torch.Tensor) -> torch.Tensor:
    """Our code predictor, teacher-forced, one token per step for every frame at once: h (F, H), cp_in (F, 15, H)
    = [C(cb0), E_0(cb1), ..., E_13(cb14)] -> logits (F, 15, V) of cb1..cb15."""
    cp = model.talker.code_predictor
    F_, dev = h.shape[0], h.device
    x = cp.small_to_mtp_projection(torch.cat((h[:, None], cp_in), dim=1))  # (F, 16, H_cp)
    cache = cp.model.new_cache(F_, 16, dev, x.dtype)
    slots = torch.arange(F_, device=dev)
    pos = torch.arange(16, device=dev)[None].expand(F_, -1)
    hidden = [cp.model(x[:, t : t + 1], pos[:, t : t + 1], cache, slots, t + 1)[:, 0] for t in range(16)]
    return torch.stack([cp.lm_head[j](hidden[j + 1]) for j in range(15)], dim=1).float()


def _official_tf_incremental(tts, seq: torch.Tensor, prefill_len: int, cp_in: torch.Tensor, codes: torch.Tensor):
    """The official talker and code predictor as its generation runs them, teacher-forced: the prompt as one
    forward, then one token at a time on its KV cache; per frame, the code predictor's two prompt tokens as one
    forward, then each of its 14 codes fed back as `generate` feeds it (input ids, `generation_steps`).
    -> (talker logits at L-1.., cp logits (F, 15, V))."""
    talker = tts.model.talker
    out = talker.model(inputs_embeds=seq[None, :prefill_len], use_cache=True)
    past, hs = out.past_key_values, [out.last_hidden_state[0, -1]]
    for p in range(prefill_len, len(seq)):
        out = talker.model(inputs_embeds=seq[None, p : p + 1], past_key_values=past, use_cache=True)
        past = out.past_key_values
        hs.append(out.last_hidden_state[0, -1])
    h = torch.stack(hs)
    logits = talker.codec_head(h).float()
    cpm = talker.code_predictor
    frames = []
    for f in range(len(h)):
        o = cpm(inputs_embeds=torch.stack((h[f], cp_in[f, 0]))[None], use_cache=True)
        row, past = [o.logits[0, -1]], o.past_key_values
        for j in range(1, 15):
            o = cpm(input_ids=codes[f : f + 1, j : j + 1], past_key_values=past, use_cache=True, generation_steps=j)
            row.append(o.logits[0, -1])
            past = o.past_key_values
        frames.append(torch.stack(row))
    return logits, torch.stack(frames).float()


def _official_tf(tts, seq: torch.Tensor, prefill_len: int, cp_in_of) -> tuple[torch.Tensor, torch.Tensor]:
    """The official talker and code predictor over the same inputs: (talker logits at L-1.., cp logits (F, 15, V))."""
    talker = tts.model.talker
    h = talker.model(inputs_embeds=seq[None], use_cache=False).last_hidden_state[0, prefill_len - 1 :]
    logits = talker.codec_head(h).float()
    cpm = talker.code_predictor
    x = cpm.small_to_mtp_projection(torch.cat((h[:, None], cp_in_of(h.dtype)), dim=1))
    hc = cpm.model(inputs_embeds=x, use_cache=False).last_hidden_state
    cp_logits = torch.stack([cpm.lm_head[j](hc[:, j + 1]) for j in range(15)], dim=1).float()
    return logits, cp_logits


# A top-2 gap (logits) above every bf16 difference seen between two implementations (at most ~0.1 on the
# full-size random checkpoints): a position where bf16 rounding alone cannot flip the top-1.
CLEAR_GAP = 0.125


def _agreement(a: torch.Tensor, b: torch.Tensor, ref_scale: torch.Tensor) -> dict:
    """Top-1 agreement, max |diff| and RMS diff relative to the reference's RMS, of two logit tensors (..., V); where
    the top-1 differs, b's gap between the two ids (how near a tie the flip was) against b's median top-2 gap; and
    the top-1 agreement over the positions whose top-2 gap in b exceeds CLEAR_GAP (no near-tie), with their share."""
    same = a.argmax(-1) == b.argmax(-1)
    top2 = b.topk(2, dim=-1).values
    gap = top2[..., 0] - top2[..., 1]
    flipped = gap[~same]
    clear = gap > CLEAR_GAP
    return {
        "top1_agreement": round(same.float().mean().item(), 4),
        "top1_agreement_clear": round(same[clear].float().mean().item(), 4) if clear.any() else None,
        "clear_share": round(clear.float().mean().item(), 4),
        "flip_gap_max": round(flipped.max().item(), 4) if flipped.numel() else None,
        "median_top2_gap": round(gap.median().item(), 4),
        "max_abs_diff": round((a - b).abs().max().item(), 4),
        "rel_rms_diff": round(((a - b).pow(2).mean().sqrt() / ref_scale.pow(2).mean().sqrt()).item(), 5),
        "positions": int(a[..., 0].numel()),
    }


@torch.inference_mode()
def teacher_forced(size: str, device: str, frames: int, workdir: Path, seed: int, out: Path | None) -> dict:
    """Teacher-forced agreement on a full-size random checkpoint: the same input sequence (a prompt and `frames`
    frames our float32 model generated greedily) through our talker and code predictor in float32, in bf16 on
    the eager path and in bf16 on the fused CUDA path, and through the official package in bf16. Talker logits are
    compared over the codebook ids (the sampler suppresses the rest), code-predictor logits over its vocabulary."""
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_tf32 = False
    ours = import_ours(
        [
            "model.random_checkpoint",
            "model.loading",
            "model.reference_loop",
            "model.prompt",
            "model.tokenizer",
            "model.layers",
            "engine_api",
            "fastpath",
        ]
    )
    off = import_official()
    ckpt = workdir / f"random-{size}-seed{seed}"
    if not (ckpt / "speech_tokenizer/model.safetensors").is_file():
        ours.random_checkpoint.write_random_checkpoint(ckpt, size=size, seed=seed)
    m32 = ours.loading.load_model(ckpt, device=device, dtype=torch.float32)
    tc = m32.config.talker
    seq32, cp_in32, codes, L = _teacher_inputs(ours, m32, frames)
    V = tc.codebook_size

    results: dict = {"size": size, "frames": frames, "prefill_len": L, "device": device}
    h32, lg32 = _ours_talker_tf(m32, seq32, L)
    cp32 = _ours_cp_tf(m32, h32, cp_in32)
    ref = {"fp32": (lg32[:, :V], cp32)}
    m16 = ours.loading.load_model(ckpt, device=device, dtype=torch.bfloat16)
    seq16, cp_in16 = seq32.bfloat16(), cp_in32.bfloat16()
    h, lg = _ours_talker_tf(m16, seq16, L)
    ref["bf16"] = (lg[:, :V], _ours_cp_tf(m16, h, cp_in16))
    with ours_active():
        from qwen_tts.engines.native.engine import talker_cache_len
        from qwen_tts.fastpath.options import FastPath

        # The engine's path at its defaults (fastpath.build, as NativeEngine sets it up; on CPU the eager layers):
        # the talker one token a step; the code predictor one frame a call (one stream) and every frame in one call
        # (a batch of streams).
        default = ours.engine_api.EngineSettings()
        fast = FastPath.preset(default.fast_path)
        runs = [("engine", fast)]
        if not fast.fused_emulate_casts:  # and rounded where the eager layers round (fused.Regions)
            runs.append(("engine-emulate-casts", dataclasses.replace(fast, fused_emulate_casts=True)))
        if fast.cp_input_tables and not isinstance(m16.talker.code_predictor.small_to_mtp_projection, nn.Identity):
            # and the code predictor's inputs through the projection each pass, as the official computes them
            runs.append(("engine-no-tables", dataclasses.replace(fast, cp_input_tables=False)))
            runs.append(("engine-emulate-casts-no-tables", dataclasses.replace(runs[-1][1], fused_emulate_casts=True)))
        pad_to = None
        if device.startswith("cuda"):  # the engine's CUDA prefill runs at the prompt's length bucket
            from qwen_tts.engines.native.prefill import len_buckets

            pad_to = next(b for b in len_buckets(default.max_text_tokens + L) if b >= L)
        results["engine_prefill_len"] = pad_to or L
        for name, variant in runs:
            ours.fastpath.build(
                m16.talker, m16.code2wav, variant, torch.device(device), talker_cache_len(default),
                default.fused_deterministic,
            )  # fmt: skip
            if m16.talker.kernels is None and name != "engine":
                continue  # no fast path here: the variants are the eager layers again
            for per_call in (1, frames):
                _, lg, cp = ours.reference_loop.teacher_forced_logits(m16.talker, seq16, L, codes, per_call, pad_to)
                ref[f"{name}-{per_call}"] = (lg[:, :V], cp)
    del m16
    # float32 official == float32 ours first: the teacher-forced inputs reach both implementations alike.
    tts = load_official(off, ckpt, device, torch.float32, values=False)
    lo, co = _official_tf(tts, seq32, L, lambda dt: cp_in32.to(dt))
    ref["official-fp32"] = (lo[:, :V], co)
    del tts
    # The official package in bf16 three ways: one full forward (eager attention), and as its generation runs
    # (incremental, on its KV cache) with eager attention and with SDPA (what loading without an
    # attn_implementation gives: the baseline's configuration).
    for attn in ("eager", "sdpa"):
        tts = load_official(off, ckpt, device, torch.bfloat16, values=False, attn=attn)
        if attn == "eager":
            lo, co = _official_tf(tts, seq16, L, lambda dt: cp_in16.to(dt))
            ref["official-bf16"] = (lo[:, :V], co)
        lo, co = _official_tf_incremental(tts, seq16, L, cp_in16, codes)
        ref[f"official-bf16-incremental-{attn}"] = (lo[:, :V], co)
        del tts
    inc = ("official-bf16-incremental-sdpa", "official-bf16-incremental-eager")
    engines = [k for k in ref if k.startswith("engine")]
    pairs = [("official-fp32", "fp32"), ("bf16", "fp32"), ("official-bf16", "fp32"), (inc[0], "fp32"),
             ("bf16", "official-bf16"), (inc[0], "official-bf16"), (inc[0], inc[1]), ("bf16", inc[0]),
             ("bf16", inc[1])]  # fmt: skip
    pairs += [(e, b) for e in engines for b in ("fp32", inc[0], inc[1], "bf16")]
    for a, b in pairs:
        if a in ref and b in ref:
            results[f"{a} vs {b}"] = {
                "talker": _agreement(ref[a][0], ref[b][0], ref["fp32"][0]),
                "code_predictor": _agreement(ref[a][1], ref[b][1], ref["fp32"][1]),
            }
    for key, val in results.items():
        print(key, val)
    if out is not None:
        import json

        out.write_text(json.dumps(results, indent=2))
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path(__file__).with_name("fixture_tiny.pt"), help="tiny fixture path")
    ap.add_argument("--size", choices=["tiny", "0.6b", "1.7b"], default="tiny")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--frames", type=int, default=16, help="frames per generation in --size 0.6b/1.7b mode")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32", help="full-size mode dtype")
    ap.add_argument("--workdir", type=Path, default=Path(tempfile.gettempdir()), help="where full-size checkpoints go")
    ap.add_argument("--teacher-forced", action="store_true", help="full-size: teacher-forced top-1 agreement")
    ap.add_argument("--json", type=Path, default=None, help="--teacher-forced: write the figures here")
    ap.add_argument("--bf16-out", type=Path, default=None, help="write the tiny bf16 parity fixture here instead")
    a = ap.parse_args()
    torch.manual_seed(0)
    if a.bf16_out is not None:
        record_tiny_bf16(a.bf16_out, a.seed)
    elif a.teacher_forced:
        teacher_forced(a.size, a.device, a.frames, a.workdir, a.seed, a.json)
    elif a.size == "tiny":
        record_tiny(a.out, a.seed, a.device)
    else:
        compare_full_size(a.size, a.device, a.frames, getattr(torch, a.dtype), a.workdir, a.seed)


if __name__ == "__main__":
    main()
