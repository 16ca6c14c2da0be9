"""Offline batch synthesis from a JSON manifest: thin entry point over `tts_tools.batch` (see docs/tools.md)."""

from tts_tools.batch import main

if __name__ == "__main__":
    raise SystemExit(main())
