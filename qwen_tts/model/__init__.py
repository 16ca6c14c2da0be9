"""The Qwen3-TTS model in PyTorch: pure, parity-tested against the official package; imports no kernel."""
