"""Record what the official qwen-tts 0.1.1 computes for ICL voice cloning on our tiny random checkpoint.

Runs in the reference venv (.venv-ref, see README.md), never in ours; our checkpoint writer is imported first and
hidden before the official package is imported (make_fixture.py's helpers).

    .venv-ref/bin/python tests/reference/make_icl_fixture.py --out tests/reference/fixture_icl_tiny.pt

For each case it calls `Qwen3TTSModel.generate_voice_clone` with a `VoiceClonePromptItem` whose ref_code, ref_text and
ref_spk_embedding are given directly (icl_mode=True, so no speech-tokenizer encoder runs), greedy, EOS held off, and
saves: the reference ids, the prefill / trailing / tpad embeddings captured at the call of `talker.generate`, the
generated codes (captured at the return of `model.generate`) and the output audio (decode of reference + generated
codes, reference part cut). `tests/test_icl_parity.py` compares our implementation against it with the .venv only.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from make_fixture import (
    capture_talker,
    greedy_frames,
    import_official,
    import_ours,
    load_official,
    save_fixture,
    tiny_meta,
    write_tiny,
)

FRAMES = 16  # generated frames per case
TEXTS = {"en": "Hello world, the quick brown fox.", "zh": "你好，世界。这是一个测试。"}
REF_TEXTS = {"en": "This is what the reference clip says.", "zh": "参考音频说的是这句话。"}
# (text, reference transcript, reference frames, language, non_streaming). In streaming mode a 3- or 4-frame reference
# is shorter than the reference + target text (the text left over trails into the decode steps), a 62- or 80-frame
# one longer (the text is padded with tpad). With 16 generated frames, 31 is a reference length where the official
# cut lands one sample before 31 * 1920.
CASES = [
    ("en", "en", 3, "english", False),
    ("en", "en", 3, "english", True),
    ("en", "en", 62, "english", False),
    ("en", "en", 62, "english", True),
    ("zh", "zh", 4, "chinese", False),
    ("zh", "zh", 80, "chinese", False),
    ("zh", "zh", 80, "chinese", True),
    ("zh", "en", 31, "auto", False),
]


@torch.inference_mode()
def record(out: Path, seed: int) -> None:
    ours = import_ours(["model.random_checkpoint"])
    off = import_official()
    from qwen_tts import VoiceClonePromptItem

    ckpt = write_tiny(ours, seed, "qwen_tts_icl_fixture_")
    tts = load_official(off, ckpt, "cpu")
    hidden = tts.model.talker.config.hidden_size
    xvector = torch.randn(hidden, generator=torch.Generator().manual_seed(7))
    gen = torch.Generator().manual_seed(3)

    model_generate = tts.model.generate
    returned: dict = {}

    def generate(*args, **kwargs):
        codes, hiddens = model_generate(*args, **kwargs)
        returned.update(codes=codes[0].cpu(), kwargs={k: kwargs[k] for k in ("repetition_penalty", "do_sample")})
        return codes, hiddens

    tts.model.generate = generate
    cases = []
    for text_key, ref_key, frames, language, non_streaming in CASES:
        ref_codes = torch.randint(0, 2048, (frames, 16), generator=gen)
        item = VoiceClonePromptItem(
            ref_code=ref_codes,
            ref_spk_embedding=xvector,
            x_vector_only_mode=False,
            icl_mode=True,
            ref_text=REF_TEXTS[ref_key],
        )
        with capture_talker(tts, FRAMES) as seen:
            wavs, sr = tts.generate_voice_clone(
                text=TEXTS[text_key],
                language=language,
                voice_clone_prompt=[item],
                non_streaming_mode=non_streaming,
                **greedy_frames(FRAMES),
            )
        assert sr == 24000 and returned["codes"].shape == (FRAMES, 16), "EOS was not held off"
        ref_ids = tts._tokenize_texts([tts._build_ref_text(REF_TEXTS[ref_key])])[0][0, 3:-2].tolist()
        cases.append(
            dict(
                text=TEXTS[text_key],
                ref_text=REF_TEXTS[ref_key],
                ref_ids=ref_ids,
                ref_codes=ref_codes,
                language=language,
                non_streaming=non_streaming,
                codes=returned["codes"],
                audio=torch.from_numpy(wavs[0]).float(),
                repetition_penalty=float(returned["kwargs"]["repetition_penalty"]),
                **seen,
            )
        )
        print(f"{language} non_streaming={non_streaming} ref {frames} frames: prefill {tuple(seen['prefill'].shape)}")
    fx = {
        "meta": tiny_meta(ours, ckpt, seed, frames=FRAMES),
        "xvector": xvector,
        "cases": cases,
    }
    save_fixture(fx, out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    here = Path(__file__).with_name("fixture_icl_tiny.pt")
    ap.add_argument("--out", type=Path, default=here, help="fixture path")
    ap.add_argument("--seed", type=int, default=0, help="the tiny checkpoint's seed")
    a = ap.parse_args()
    torch.manual_seed(0)
    record(a.out, a.seed)


if __name__ == "__main__":
    main()
