"""Helpers shared by the command-line tools: user-facing errors, model and device resolution."""

from __future__ import annotations

from pathlib import Path

import torch


class CliError(Exception):
    """Bad input from the user: printed as `error: <line>` lines, exit status 1, no traceback."""


def resolve_model(spec: str) -> Path:
    """`--model` -> checkpoint folder, as the server does ('demo', a folder, or a hub id in the local HF cache)."""
    from qwen_tts.demo import resolve_model_path

    try:
        return Path(resolve_model_path(spec))
    except Exception as e:  # not found, not a checkpoint, cache missing: the reason is what the user needs
        raise CliError(f"--model {spec!r}: {e}") from None


def resolve_device(spec: str) -> torch.device:
    if spec == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(spec)
    except RuntimeError:
        raise CliError(f"--device {spec!r}: expected auto, cpu, cuda or cuda:N") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise CliError(f"--device {spec!r}: CUDA is not available on this machine")
    return dev


def model_label(spec: str, path: Path, cfg: object) -> str:
    """What a profile records as its model: a readable name plus the size tag ('Qwen3-TTS-12Hz-1.7B-Base [1b7]')."""
    name = path.name if Path(spec).exists() else spec
    size = getattr(cfg, "tts_model_size", "")
    return f"{name} [{size}]" if size else name
