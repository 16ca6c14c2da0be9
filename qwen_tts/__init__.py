"""Qwen3-TTS-12Hz: our PyTorch implementation, engine interface and voice profiles."""
