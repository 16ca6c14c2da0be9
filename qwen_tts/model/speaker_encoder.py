"""ECAPA-TDNN speaker encoder: 24 kHz log-mel frames -> x-vector (the talker's voice embedding).

Reimplements qwen-tts 0.1.1 `Qwen3TTSSpeakerEncoder` and its parts (`TimeDelayNetBlock`, `Res2NetBlock`,
`SqueezeExcitationBlock`, `AttentiveStatisticsPooling`) and `extract_speaker_embedding`
(`core/models/modeling_qwen3_tts.py`). No batch norm; every conv pads "same" by reflection.
Attribute names mirror the checkpoint's `speaker_encoder.*` keys.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from qwen_tts.model.config import SpeakerEncoderConfig
from qwen_tts.model.mel import mel_spectrogram, min_samples_for_frames


def _conv(c_in: int, c_out: int, kernel_size: int = 1, dilation: int = 1) -> nn.Conv1d:
    if kernel_size == 1:  # "same" needs no padding; skips a no-op reflect pad call per conv
        return nn.Conv1d(c_in, c_out, 1)
    return nn.Conv1d(c_in, c_out, kernel_size, dilation=dilation, padding="same", padding_mode="reflect")


class TDNNBlock(nn.Module):
    """Conv1d + ReLU (a time-delay layer)."""

    def __init__(self, c_in: int, c_out: int, kernel_size: int, dilation: int):
        super().__init__()
        self.conv = _conv(c_in, c_out, kernel_size, dilation)

    def forward(self, x: Tensor) -> Tensor:
        return torch.relu(self.conv(x))


class Res2NetBlock(nn.Module):
    """Channel groups processed hierarchically: group 0 passes through, group i sees group i plus output i-1."""

    def __init__(self, channels: int, scale: int, kernel_size: int, dilation: int):
        super().__init__()
        self.scale = scale
        width = channels // scale
        self.blocks = nn.ModuleList([TDNNBlock(width, width, kernel_size, dilation) for _ in range(scale - 1)])

    def forward(self, x: Tensor) -> Tensor:
        parts = x.chunk(self.scale, dim=1)
        outs = [parts[0]]
        y = None
        for part, block in zip(parts[1:], self.blocks, strict=True):
            y = block(part if y is None else part + y)
            outs.append(y)
        return torch.cat(outs, dim=1)


class SEBlock(nn.Module):
    """Squeeze-excitation: channel gates from the time-mean."""

    def __init__(self, channels: int, se_channels: int):
        super().__init__()
        self.conv1 = _conv(channels, se_channels)
        self.conv2 = _conv(se_channels, channels)

    def forward(self, x: Tensor) -> Tensor:
        gate = torch.sigmoid(self.conv2(torch.relu(self.conv1(x.mean(dim=2, keepdim=True)))))
        return x * gate


class SERes2NetBlock(nn.Module):
    """TDNN k1 -> Res2Net -> TDNN k1 -> SE, plus residual."""

    def __init__(self, c_in: int, c_out: int, scale: int, se_channels: int, kernel_size: int, dilation: int):
        super().__init__()
        self.tdnn1 = TDNNBlock(c_in, c_out, 1, 1)
        self.res2net_block = Res2NetBlock(c_out, scale, kernel_size, dilation)
        self.tdnn2 = TDNNBlock(c_out, c_out, 1, 1)
        self.se_block = SEBlock(c_out, se_channels)

    def forward(self, x: Tensor) -> Tensor:
        return x + self.se_block(self.tdnn2(self.res2net_block(self.tdnn1(x))))


def _mean_std(x: Tensor, w: Tensor) -> tuple[Tensor, Tensor]:
    """Weighted mean and std over time; w (B, 1 or C, T) sums to 1 over time."""
    mean = (w * x).sum(dim=2)
    var = (w * (x - mean.unsqueeze(2)).pow(2)).sum(dim=2)
    return mean, var.clamp(min=1e-12).sqrt()


class AttentiveStatsPool(nn.Module):
    """Attention over time, conditioned on the global mean/std, then the attended mean and std: C -> 2C."""

    def __init__(self, channels: int, attention_channels: int):
        super().__init__()
        self.tdnn = TDNNBlock(channels * 3, attention_channels, 1, 1)
        self.conv = _conv(attention_channels, channels)

    def forward(self, x: Tensor) -> Tensor:
        t = x.shape[2]
        mean, std = _mean_std(x, x.new_full((1, 1, t), 1.0 / t))
        context = torch.cat([x, mean.unsqueeze(2).expand(-1, -1, t), std.unsqueeze(2).expand(-1, -1, t)], dim=1)
        attn = torch.softmax(self.conv(torch.tanh(self.tdnn(context))), dim=2)
        mean, std = _mean_std(x, attn)
        return torch.cat([mean, std], dim=1).unsqueeze(2)  # (B, 2C, 1)


class SpeakerEncoder(nn.Module):
    """(B, frames, mel_dim) log-mel -> (B, enc_dim) x-vector."""

    def __init__(self, cfg: SpeakerEncoderConfig):
        super().__init__()
        ch, ks, dil = cfg.enc_channels, cfg.enc_kernel_sizes, cfg.enc_dilations
        if not len(ch) == len(ks) == len(dil):
            raise ValueError("enc_channels, enc_kernel_sizes and enc_dilations must have the same length")
        self.cfg = cfg
        self.blocks = nn.ModuleList([TDNNBlock(cfg.mel_dim, ch[0], ks[0], dil[0])])
        for i in range(1, len(ch) - 1):
            self.blocks.append(
                SERes2NetBlock(ch[i - 1], ch[i], cfg.enc_res2net_scale, cfg.enc_se_channels, ks[i], dil[i])
            )
        # Multi-layer feature aggregation over the concatenated SE-Res2Net outputs.
        self.mfa = TDNNBlock(sum(ch[1:-1]), ch[-1], ks[-1], dil[-1])
        self.asp = AttentiveStatsPool(ch[-1], cfg.enc_attention_channels)
        self.fc = _conv(ch[-1] * 2, cfg.enc_dim)
        # Reflection padding needs more frames than the widest one-sided pad of any conv.
        self.min_frames = 1 + max((k - 1) * d - (k - 1) * d // 2 for k, d in zip(ks, dil, strict=True))
        self.min_samples = min_samples_for_frames(self.min_frames)

    def forward(self, mel: Tensor) -> Tensor:
        h = self.blocks[0](mel.transpose(1, 2))  # (B, C, frames)
        feats = []
        for block in self.blocks[1:]:
            h = block(h)
            feats.append(h)
        h = self.mfa(torch.cat(feats, dim=1))
        return self.fc(self.asp(h)).squeeze(2)

    @torch.inference_mode()
    def embed(self, wav24k: Tensor) -> Tensor:
        """(N,) float32 mono 24 kHz waveform -> (enc_dim,) float32 x-vector."""
        if wav24k.dim() != 1:
            raise ValueError(f"expected a mono waveform (N,), got shape {tuple(wav24k.shape)}")
        n = wav24k.shape[0]
        if n < self.min_samples:
            raise ValueError(f"audio too short for a speaker embedding: {n} samples at 24 kHz, need {self.min_samples}")
        p = next(self.parameters())
        mel = mel_spectrogram(wav24k.to(device=p.device, dtype=torch.float32)[None])
        return self(mel.to(p.dtype))[0].float()
