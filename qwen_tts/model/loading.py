"""Load a Qwen3-TTS-12Hz Base checkpoint directory (official layout) into our modules, strictly.

Replaces qwen-tts 0.1.1 `Qwen3TTSForConditionalGeneration.from_pretrained` + `Qwen3TTSTokenizer.from_pretrained`
for the parts we run: talker (with code predictor), Code2Wav decoder, speaker encoder, text tokenizer. Every tensor
our modules need must be in the file with the right shape and every tensor in the file must be used, except the
documented groups we never run (`encoder.*` of the speech tokenizer: the Mimi encoder is ICL only; `speaker_encoder.*`
when the speaker encoder is not requested). After loading, two traps seen in other ports are checked: the
`text_projection` biases hold the file's values, and the RoPE inverse frequencies (not stored in checkpoints) match
theta and head_dim of the config.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from qwen_tts.model.codec_decoder import Code2Wav
from qwen_tts.model.config import ConfigError, ModelConfig
from qwen_tts.model.speaker_encoder import SpeakerEncoder
from qwen_tts.model.talker import Talker
from qwen_tts.model.tokenizer import TextTokenizer

MAIN_FILE = "model.safetensors"
SPEECH_TOKENIZER_FILE = "speech_tokenizer/model.safetensors"


class CheckpointError(Exception):
    """A checkpoint directory that does not match what the config and our modules need."""


@dataclass
class Qwen3TTS:
    """Everything the engine, the server and the tools run, loaded from one checkpoint directory."""

    config: ModelConfig
    tokenizer: TextTokenizer
    talker: Talker
    code2wav: Code2Wav | None
    speaker_encoder: SpeakerEncoder | None
    path: Path
    device: torch.device
    dtype: torch.dtype


def default_dtype(device: torch.device | str) -> torch.dtype:
    """bfloat16 on CUDA (as released), float32 elsewhere."""
    return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32


def resolve_device(spec: str) -> torch.device:
    """'auto' -> cuda when available, else cpu; otherwise the named device, refused if CUDA is missing.

    Messages leave out the spec: callers name their own option and value in front."""
    if spec == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(spec)
    except RuntimeError:
        raise ValueError("expected auto, cpu, cuda or cuda:N") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("CUDA is not available on this machine")
    return dev


DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}


def resolve_dtype(spec: str | None, device: torch.device) -> torch.dtype:
    """None -> `default_dtype(device)`; otherwise one of DTYPES."""
    if spec is None:
        return default_dtype(device)
    if spec not in DTYPES:
        raise ValueError(f"expected one of {', '.join(sorted(DTYPES))}")
    return DTYPES[spec]


def read_config(path: str | Path) -> ModelConfig:
    """The typed config of a checkpoint directory; a bad or missing config is a CheckpointError."""
    try:
        return ModelConfig.from_pretrained(path)
    except (ConfigError, OSError, ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"{Path(path)}: bad config: {e}") from e


def load_model(
    path: str | Path,
    device: torch.device | str = "cpu",
    dtype: torch.dtype | None = None,
    *,
    code2wav: bool = True,
    speaker_encoder: bool = False,
) -> Qwen3TTS:
    """Load talker + tokenizer (+ Code2Wav, + speaker encoder) for inference.

    The talker and speaker encoder run in `dtype` (default: bfloat16 on CUDA, float32 otherwise); Code2Wav always
    runs in float32 (bf16 decoding gives NaN/silence in other stacks, and the file is float32).
    """
    root = Path(path)
    device = torch.device(device)
    dtype = dtype or default_dtype(device)
    cfg = read_config(root)
    if speaker_encoder and cfg.speaker_encoder is None:
        raise CheckpointError(f"{root}: no speaker encoder (tts_model_type={cfg.tts_model_type!r}, need 'base')")
    if code2wav and cfg.speech_tokenizer is None:
        raise CheckpointError(f"{root}: speech_tokenizer/config.json not found (needed for Code2Wav)")
    try:
        tokenizer = TextTokenizer.from_pretrained(root)
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{root}: bad text tokenizer: {e}") from e

    talker = _build(Talker, cfg.talker, device)
    enc = _build(SpeakerEncoder, cfg.speaker_encoder, device) if speaker_encoder else None
    groups = {"talker": talker, **({"speaker_encoder": enc} if enc is not None else {})}
    ignored = () if enc is not None else ("speaker_encoder.",)
    _load_file(root / MAIN_FILE, groups, ignored)
    check_text_projection_bias(talker, root / MAIN_FILE)

    decoder = None
    if code2wav:
        decoder = _build(Code2Wav, cfg.speech_tokenizer.decoder, device)
        _load_file(root / SPEECH_TOKENIZER_FILE, {"decoder": decoder}, ignored=("encoder.",))
        decoder = _ready(decoder, device, torch.float32)

    talker = _ready(talker, device, dtype)
    enc = _ready(enc, device, dtype) if enc is not None else None
    check_rope(cfg, talker, decoder)
    return Qwen3TTS(cfg, tokenizer, talker, decoder, enc, root, device, dtype)


def load_speaker_encoder(
    path: str | Path, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32
) -> tuple[SpeakerEncoder, ModelConfig]:
    """Only the speaker encoder (reads only `speaker_encoder.*` tensors): what the voice extractor needs."""
    root = Path(path)
    cfg = read_config(root)
    if cfg.speaker_encoder is None:
        raise CheckpointError(f"{root}: no speaker encoder (tts_model_type={cfg.tts_model_type!r}, need 'base')")
    enc = _build(SpeakerEncoder, cfg.speaker_encoder, torch.device(device))
    _load_file(root / MAIN_FILE, {"speaker_encoder": enc}, ignored=("talker.",))
    return _ready(enc, torch.device(device), dtype), cfg


# --------------------------------------------------------------------------------------------------------------


@contextlib.contextmanager
def _no_init() -> Iterator[None]:
    """Skip the random init of parameters that the checkpoint overwrites anyway (seconds at full size).

    Buffers computed in constructors (RoPE tables) are unaffected: they do not go through torch.nn.init.
    """
    names = [n for n in dir(nn.init) if n.endswith("_") and not n.startswith("_")]
    saved = {n: getattr(nn.init, n) for n in names}
    try:
        for n in names:
            setattr(nn.init, n, lambda t, *a, **k: t)
        yield
    finally:
        for n, f in saved.items():
            setattr(nn.init, n, f)


def _build(cls: type[nn.Module], cfg: object, device: torch.device) -> nn.Module:
    with _no_init(), torch.device(device):
        return cls(cfg)


def _ready(module: nn.Module, device: torch.device, dtype: torch.dtype) -> nn.Module:
    module.to(device=device, dtype=dtype)
    module.requires_grad_(False)
    return module.eval()


def _fmt(names: list[str], limit: int = 8) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f", ... ({len(names)} in all)" if len(names) > limit else "")


def _load_file(file: Path, groups: dict[str, nn.Module], ignored: tuple[str, ...]) -> None:
    """Copy `<group>.*` tensors of `file` into each module's state_dict; strict on names and shapes.

    Only the needed tensors are read (safetensors reads lazily), so ignored groups cost nothing.
    """
    if not file.is_file():
        raise CheckpointError(f"{file}: not found")
    wanted: dict[str, tuple[nn.Module, str, torch.Tensor]] = {}
    for prefix, module in groups.items():
        for name, t in module.state_dict().items():
            wanted[f"{prefix}.{name}"] = (module, name, t)
    try:
        handle = safe_open(str(file), framework="pt", device="cpu")
    except Exception as e:  # a truncated or non-safetensors file
        raise CheckpointError(f"{file}: cannot read safetensors: {e}") from e
    with handle as f:
        keys = set(f.keys())
        missing = sorted(k for k in wanted if k not in keys)
        unexpected = sorted(k for k in keys if k not in wanted and not k.startswith(ignored))
        if missing:
            raise CheckpointError(f"{file}: missing tensors: {_fmt(missing)}")
        if unexpected:
            raise CheckpointError(f"{file}: unexpected tensors: {_fmt(unexpected)}")
        bad = []
        for k, (_, _, t) in wanted.items():
            shape = tuple(f.get_slice(k).get_shape())
            if shape != tuple(t.shape):
                bad.append(f"{k} expected {tuple(t.shape)} found {shape}")
        if bad:
            raise CheckpointError(f"{file}: wrong tensor shapes: {_fmt(bad, 4)}")
        states: dict[nn.Module, dict[str, torch.Tensor]] = {}
        for k, (module, name, _) in wanted.items():
            states.setdefault(module, {})[name] = f.get_tensor(k)
    for module, state in states.items():
        # strict=True: a module whose state_dict changed between listing and loading would be a bug here.
        module.load_state_dict(state, strict=True)


def check_text_projection_bias(talker: Talker, file: Path) -> None:
    """The talker's text_projection biases equal the file's (transformers 5 ports silently dropped them)."""
    with safe_open(str(file), framework="pt", device="cpu") as f:
        for name in ("linear_fc1", "linear_fc2"):
            key = f"talker.text_projection.{name}.bias"
            ours = getattr(talker.text_projection, name).bias
            if ours is None or not torch.equal(ours.detach().cpu(), f.get_tensor(key).to(ours.dtype)):
                raise CheckpointError(f"{file}: {key} was not loaded")


def expected_inv_freq(theta: float, head_dim: int) -> torch.Tensor:
    """Default RoPE inverse frequencies 1 / theta^(2i / head_dim), float32."""
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))


def check_rope(cfg: ModelConfig, talker: Talker, code2wav: Code2Wav | None) -> None:
    """Every `inv_freq` buffer matches its component's theta/head_dim (they are not in the checkpoint)."""
    parts = [
        ("talker.model", talker.model, cfg.talker),
        ("talker.code_predictor", talker.code_predictor, cfg.talker.code_predictor),
    ]
    if code2wav is not None:
        parts.append(("code2wav", code2wav, cfg.speech_tokenizer.decoder))
    for label, module, c in parts:
        buffers = [(n, b) for n, b in module.named_buffers() if n.endswith("inv_freq")]
        if not buffers:
            raise CheckpointError(f"{label}: no RoPE inv_freq buffer to check")
        want = expected_inv_freq(c.rope_theta, c.head_dim)
        for name, b in buffers:
            got = b.detach().float().cpu()
            if got.shape != want.shape or not torch.allclose(got, want, rtol=1e-6, atol=0) or not got.all():
                raise CheckpointError(f"{label}.{name}: RoPE inverse frequencies do not match theta/head_dim")
