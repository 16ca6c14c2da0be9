"""Qwen3-TTS-12Hz: our PyTorch model, the engine interface (`engine_api`), the engines (`engines`) and voices.

See docs/architecture.md for the parts and the import rules between them.
"""
