"""vLLM-Omni plugins for the Qwen3-TTS server (see README.md). Importing this package has no side effects."""

__version__ = "0.1.0"
