"""Enroll voices from reference clips into voice profiles: thin entry point over `tts_tools.extract` (docs/tools.md)."""

from tts_tools.extract import main

if __name__ == "__main__":
    raise SystemExit(main())
