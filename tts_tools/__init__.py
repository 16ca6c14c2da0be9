"""Command-line tools over the engine and the voice profile format: voice extraction and batch synthesis."""
