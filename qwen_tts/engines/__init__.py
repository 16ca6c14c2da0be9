"""Engine implementations behind `qwen_tts.engine_api.Engine`."""
