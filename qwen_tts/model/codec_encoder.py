"""The 12 Hz speech tokenizer's encoder: a 24 kHz clip -> (T, 16) codec codes at 12.5 Hz (ICL reference codes).

Reimplements qwen-tts 0.1.1 `Qwen3TTSTokenizerV2Model.encode` (`core/tokenizer_12hz/modeling_qwen3_tts_tokenizer_v2.py`),
which runs transformers 4.57.3 `MimiModel.encode` (`models/mimi/modeling_mimi.py`) with the decoder parts removed:
a causal SEANet conv encoder (`mimi_layers.SEANetEncoder`), a causal transformer (full causal attention: the config's
sliding window is applied only under FlashAttention 2, which the official loader never selects for this encoder), a strided conv down to 12.5 Hz, and a split residual vector
quantizer (`mimi_layers.SplitRVQ`) of which only the first `encoder_valid_num_quantizers` codebooks are kept. The
official cut of the codes to ceil(samples / 1920) frames is kept too. The audio front end is that of
`Qwen3TTSTokenizer.encode` for numpy input: the channel mean, then librosa's soxr_hq resampling to 24 kHz
(`qwen_tts.audio`). The tokenizer's weights are float32 and the encoder always runs in float32.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from torch import Tensor, nn

from qwen_tts.audio import SAMPLE_RATE, resample
from qwen_tts.model.config import ConfigError, SpeechTokenizerConfig
from qwen_tts.model.loading import SPEECH_TOKENIZER_FILE, CheckpointError, _build, _load_file, _ready
from qwen_tts.model.mimi_layers import MimiConv1d, MimiEncoderConfig, MimiTransformer, SEANetEncoder, SplitRVQ

SPEECH_TOKENIZER_MODEL_TYPE = "qwen3_tts_tokenizer_12hz"


class CodecEncoder(nn.Module):
    """Waveform -> codes. Weight names are those of `encoder.*` in speech_tokenizer/model.safetensors, less the
    prefix (the quantizers' `output_proj`, the `initialized` flags and the acoustic codebooks past the kept ones
    are not needed to encode and are not held)."""

    def __init__(self, cfg: MimiEncoderConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.encoder = SEANetEncoder(cfg)
        self.encoder_transformer = MimiTransformer(cfg)
        self.downsample = MimiConv1d(
            cfg.hidden_size,
            cfg.hidden_size,
            cfg.downsample_kernel,
            stride=cfg.downsample_stride,
            bias=False,
            pad_mode="replicate",
        )
        self.quantizer = SplitRVQ(cfg)

    @property
    def device(self) -> torch.device:
        return self.downsample.conv.weight.device

    def forward_latents(self, wav: Tensor) -> Tensor:
        """(B, N) 24 kHz float32 -> (B, hidden, T) pre-quantizer latents at 12.5 Hz, T = ceil(N / 1920)."""
        h = self.encoder(wav[:, None])  # (B, hidden, ceil(N / 960))
        h = self.encoder_transformer(h.transpose(1, 2)).transpose(1, 2)
        return self.downsample(h)

    def forward(self, wav: Tensor) -> Tensor:
        """(B, N) 24 kHz float32 -> (B, valid_quantizers, T) int64 codes: [semantic, acoustic 0..]."""
        return self.quantizer(self.forward_latents(wav))

    def prepare(self, wav: Tensor | np.ndarray, sample_rate: int) -> Tensor:
        """(N,) or (N, C) audio at `sample_rate` -> (1, N') float32 mono at 24 kHz on the encoder's device, as
        `Qwen3TTSTokenizer.encode` prepares numpy input (channel mean, then soxr_hq resampling)."""
        if isinstance(wav, Tensor):
            if not wav.is_floating_point():
                raise ValueError(f"expected float samples, got {wav.dtype}")
            dtype = torch.float64 if wav.dtype == torch.float64 else torch.float32
            wav = wav.detach().to(device="cpu", dtype=dtype).numpy()
        x = np.asarray(wav)
        if x.ndim not in (1, 2):
            raise ValueError(f"expected audio of shape (N,) or (N, C), got {tuple(x.shape)}")
        if not np.issubdtype(x.dtype, np.floating):
            raise ValueError(f"expected float samples, got {x.dtype}")
        if int(sample_rate) <= 0:
            raise ValueError(f"sample_rate must be positive, got {sample_rate}")
        # The channel mean in the input's own precision, then float32, as the official front end takes numpy input
        # (for float32 input this is `qwen_tts.audio.to_mono`).
        x = (x.mean(axis=-1) if x.ndim == 2 else x).astype(np.float32, copy=False)
        if x.shape[0] == 0:
            raise ValueError("empty audio: no samples to encode")
        if not np.isfinite(x).all():
            raise ValueError("audio contains NaN or infinite samples")
        x = resample(x, int(sample_rate), self.cfg.sampling_rate)
        return torch.from_numpy(np.ascontiguousarray(x))[None].to(self.device)

    def frames(self, samples_24k: int) -> int:
        """Codec frames the official encode keeps for a clip of this many 24 kHz samples."""
        return -(-samples_24k // self.cfg.downsample_rate)

    @torch.no_grad()
    def encode(self, wav: Tensor | np.ndarray, sample_rate: int) -> Tensor:
        """A clip ((N,) or (N, C) float, any rate) -> (T, valid_quantizers) int64 codes on the CPU,
        T = ceil(N_24k / 1920)."""
        x = self.prepare(wav, sample_rate)
        codes = self(x)[0, :, : self.frames(x.shape[-1])]
        return codes.transpose(0, 1).contiguous().cpu()

    @torch.no_grad()
    def latents(self, wav: Tensor | np.ndarray, sample_rate: int) -> Tensor:
        """A clip -> (T, hidden) float32 pre-quantizer latents on the CPU (what `encode` quantizes)."""
        x = self.prepare(wav, sample_rate)
        return self.forward_latents(x)[0].transpose(0, 1).contiguous().cpu()


def speech_tokenizer_dir(model_dir: str | Path) -> Path:
    """The speech tokenizer folder of a checkpoint (`speech_tokenizer/`), or `model_dir` itself when it is a
    speech tokenizer folder (as the Qwen3-TTS-Tokenizer-12Hz repository is)."""
    root = Path(model_dir)
    for d in (root / "speech_tokenizer", root):
        cfg = d / "config.json"
        if cfg.is_file():
            try:
                model_type = json.loads(cfg.read_text()).get("model_type")
            except (OSError, ValueError) as e:
                raise CheckpointError(f"{cfg}: bad config: {e}") from e
            if model_type == SPEECH_TOKENIZER_MODEL_TYPE:
                return d
    raise CheckpointError(f"{root}: no speech_tokenizer/config.json of model_type {SPEECH_TOKENIZER_MODEL_TYPE!r}")


def read_encoder_config(model_dir: str | Path) -> MimiEncoderConfig:
    """The encoder config of a checkpoint (or speech tokenizer) folder; a bad one is a CheckpointError."""
    st = speech_tokenizer_dir(model_dir)
    try:
        d = json.loads((st / "config.json").read_text())
        SpeechTokenizerConfig.from_dict(d)  # the same checks the decoder's loading makes
        return MimiEncoderConfig.from_tokenizer_dict(d)
    except (ConfigError, OSError, ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"{st / 'config.json'}: bad config: {e}") from e


def unused_tensor_prefixes(cfg: MimiEncoderConfig) -> tuple[str, ...]:
    """`encoder.*` tensors of the file that encoding never reads (see `CodecEncoder`)."""
    q = "encoder.quantizer"
    out = []
    for name, n, kept in (
        ("semantic", cfg.num_semantic_quantizers, cfg.num_semantic_quantizers),
        (
            "acoustic",
            cfg.num_quantizers - cfg.num_semantic_quantizers,
            cfg.valid_quantizers - cfg.num_semantic_quantizers,
        ),
    ):
        p = f"{q}.{name}_residual_vector_quantizer"
        out.append(f"{p}.output_proj.")
        out += [f"{p}.layers.{i}.codebook.initialized" for i in range(n)]
        out += [f"{p}.layers.{i}." for i in range(kept, n)]
    return tuple(out)


def load_codec_encoder(model_dir: str | Path, device: torch.device | str = "cpu") -> CodecEncoder:
    """The speech tokenizer's encoder of a checkpoint folder (with `speech_tokenizer/`) or of a speech tokenizer
    folder, in float32 on `device`; strict on tensor names and shapes as `loading.load_model` is."""
    st = speech_tokenizer_dir(model_dir)
    cfg = read_encoder_config(model_dir)
    device = torch.device(device)
    enc = _build(CodecEncoder, cfg, device)
    file = st / Path(SPEECH_TOKENIZER_FILE).name
    _load_file(file, {"encoder": enc}, ignored=("decoder.", *unused_tensor_prefixes(cfg)))
    return _ready(enc, device, torch.float32)


__all__ = ["SAMPLE_RATE", "CodecEncoder", "MimiEncoderConfig", "load_codec_encoder", "read_encoder_config"]
