"""Helpers shared by the command-line tools: user-facing errors, the --model and --device options, model and
device resolution."""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from qwen_tts.model.loading import resolve_device as _resolve_device
from qwen_tts.model.model_paths import resolve_model_path


class CliError(Exception):
    """Bad input from the user: printed as `error: <line>` lines, exit status 1, no traceback."""


def add_model_options(p: argparse.ArgumentParser, *, model: str, device: str) -> None:
    """--model and --device with these defaults, spelt alike in every tool."""
    p.add_argument("--model", default=model, help="checkpoint folder, hub id in the local HF cache, or 'demo'")
    p.add_argument("--device", default=device, help="auto | cpu | cuda | cuda:N (default: auto)")


def resolve_model(spec: str) -> Path:
    """`--model` -> checkpoint folder, as the server does ('demo', a folder, or a hub id in the local HF cache)."""
    try:
        return Path(resolve_model_path(spec))
    except Exception as e:  # not found, not a checkpoint, cache missing: the reason is what the user needs
        raise CliError(f"--model {spec!r}: {e}") from None


def resolve_device(spec: str) -> torch.device:
    """`--device` -> a torch device (auto: cuda when available)."""
    try:
        return _resolve_device(spec)
    except ValueError as e:
        raise CliError(f"--device {spec!r}: {e}") from None


def model_label(spec: str, path: Path, cfg: object) -> str:
    """What a profile records as its model: a readable name plus the size tag ('Qwen3-TTS-12Hz-1.7B-Base [1b7]')."""
    name = path.name if Path(spec).exists() else spec
    size = getattr(cfg, "tts_model_size", "")
    return f"{name} [{size}]" if size else name
