"""inference_config: the seed's variables and defaults, list parsing, the .env file and the API keys file, and
one-line errors for bad values."""

from __future__ import annotations

from pathlib import Path

import pytest

from inference_config import SettingsError, load_settings, unknown_env_vars

# No TTS_* variable and a working directory of the test's own (conftest.clean_tts_env).
pytestmark = pytest.mark.usefixtures("clean_tts_env")


def test_defaults_match_the_seed_and_serve_the_demo() -> None:
    s = load_settings()
    assert s.model_path == "demo"
    assert s.port == 8090
    assert s.max_concurrent == 16
    assert s.profiles_dir == Path("voice_profiles")
    assert s.stage_config == Path("stage_config_optimized.yaml")
    assert s.device == "auto"
    assert s.backend == "native"
    assert (s.temperature, s.top_k, s.max_new_tokens) == (0.9, 50, 2048)
    assert s.max_text_chars == 4096
    assert s.api_keys == [] and s.cors_origins == []


@pytest.mark.parametrize(
    ("field", "default", "value", "parsed", "bad"),
    [
        ("chunk_growth", 2, "4", 4, "1"),
        ("admission_step_budget_ms", 0.0, "64", 64.0, "-5"),  # 0: off
        ("decoder_fp16", True, "false", False, "maybe"),  # on CUDA only
        ("fast_path", "default", "one-stream", "one-stream", "fast"),  # on CUDA only
        ("fused_deterministic", True, "false", False, "sometimes"),  # on CUDA only
    ],
)
def test_engine_variables_reach_the_engine_and_are_checked(monkeypatch, field, default, value, parsed, bad) -> None:
    var = f"TTS_{field.upper()}"
    assert getattr(load_settings().engine_settings(), field) == default
    monkeypatch.setenv(var, value)
    assert getattr(load_settings().engine_settings(), field) == parsed
    monkeypatch.setenv(var, bad)
    with pytest.raises(SettingsError, match=var):
        load_settings()


def test_environment_overrides_every_seed_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    env = {
        "TTS_MODEL_PATH": "/models/qwen",
        "TTS_STAGE_CONFIG": "other.yaml",
        "TTS_PROFILES_DIR": "voices",
        "TTS_DEVICE": "CUDA:1",
        "TTS_HOST": "127.0.0.1",
        "TTS_PORT": "9000",
        "TTS_MAX_CONCURRENT": "4",
        "TTS_STAGE_INIT_TIMEOUT": "30",
        "TTS_TEMPERATURE": "0.5",
        "TTS_TOP_K": "20",
        "TTS_MAX_NEW_TOKENS": "300",
    }
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    s = load_settings()
    assert s.model_path == "/models/qwen"
    assert s.stage_config == Path("other.yaml")
    assert s.profiles_dir == Path("voices")
    assert s.device == "cuda:1"
    assert (s.host, s.port, s.max_concurrent, s.stage_init_timeout) == ("127.0.0.1", 9000, 4, 30.0)
    assert (s.temperature, s.top_k, s.max_new_tokens) == (0.5, 20, 300)
    # The vllm-omni backend's own options reach the engine as its backend options.
    assert s.engine_settings().backend_options == {
        "stage_config": Path("other.yaml"),
        "stage_init_timeout": 30.0,
        "speaker_transport": "auto",
    }


@pytest.mark.parametrize("var", ["TTS_CP_STACK_KERNEL", "TTS_TALKER_STACK_KERNEL", "TTS_SMALL_M_HEADS"])
def test_variables_replaced_by_fast_path_stop_the_server_naming_it(monkeypatch: pytest.MonkeyPatch, var: str) -> None:
    monkeypatch.setenv(var, "cuda")
    with pytest.raises(SettingsError) as info:
        load_settings()
    message = str(info.value)
    assert "\n" not in message and message.startswith(f"invalid configuration: {var}: replaced by TTS_FAST_PATH")


def test_lists_accept_commas_or_json(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TTS_API_KEYS", "key-one-123, key-two-456")
    monkeypatch.setenv("TTS_CORS_ORIGINS", '["https://a.example", "http://localhost:3000"]')
    s = load_settings()
    assert [k.get_secret_value() for k in s.api_keys] == ["key-one-123", "key-two-456"]
    assert s.cors_origins == ["https://a.example", "http://localhost:3000"]
    # Secrets never appear in the public view.
    assert s.public_dict()["api_keys"] == 2
    assert "key-one" not in repr(s)


@pytest.mark.parametrize(
    ("var", "value", "expected"),
    [
        ("TTS_PORT", "abc", "TTS_PORT='abc': Input should be a valid integer"),
        ("TTS_PORT", "70000", "TTS_PORT='70000': Input should be less than or equal to 65535"),
        ("TTS_MAX_CONCURRENT", "0", "TTS_MAX_CONCURRENT='0': Input should be greater than or equal to 1"),
        ("TTS_DEVICE", "gpu", "TTS_DEVICE='gpu': must be auto, cpu, cuda, cuda:N or mps"),
        ("TTS_BACKEND", "onnx", "TTS_BACKEND='onnx': Input should be 'native', 'vllm-omni' or 'fake'"),
        ("TTS_TEMPERATURE", "-1", "TTS_TEMPERATURE='-1': Input should be greater than or equal to 0"),
        ("TTS_CORS_ORIGINS", "*", "'*' is not allowed"),
        ("TTS_CORS_ORIGINS", "example.com", "is not an origin"),
        ("TTS_API_KEYS", "short", "TTS_API_KEYS: each API key must be at least 8 characters"),
        ("TTS_LOG_LEVEL", "loud", "TTS_LOG_LEVEL='loud'"),
        ("TTS_MODEL_PATH", "  ", "TTS_MODEL_PATH='  ': must not be empty"),
    ],
)
def test_bad_value_fails_with_one_line_naming_the_variable(
    monkeypatch: pytest.MonkeyPatch, var: str, value: str, expected: str
) -> None:
    monkeypatch.setenv(var, value)
    with pytest.raises(SettingsError) as info:
        load_settings()
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith("invalid configuration: ")
    assert expected in message


def test_secret_values_are_not_echoed_in_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TTS_API_KEYS", "good-key-123,tiny")
    with pytest.raises(SettingsError) as info:
        load_settings()
    assert "good-key" not in str(info.value) and "tiny" not in str(info.value)


@pytest.mark.parametrize(
    ("env", "match"),
    [
        # chunk sizes that contradict each other
        (
            {"TTS_FIRST_CHUNK_FRAMES": "20", "TTS_CHUNK_FRAMES": "10"},
            "TTS_FIRST_CHUNK_FRAMES must not exceed TTS_CHUNK_FRAMES",
        ),
        # a connection limit that leaves no room for the admitted requests
        (
            {"TTS_MAX_CONCURRENT": "1000", "TTS_MAX_QUEUE": "100"},
            r"TTS_MAX_CONNECTIONS \(1024\) must exceed .* \(1000 \+ 100\)",
        ),
    ],
    ids=["chunk-sizes", "connection-limit"],
)
def test_inconsistent_settings_are_refused(monkeypatch: pytest.MonkeyPatch, env: dict[str, str], match: str) -> None:
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(SettingsError, match=match):
        load_settings()


def test_the_per_client_connection_cap_follows_a_lower_global_cap(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("TTS_MAX_CONCURRENT", "TTS_MAX_QUEUE", "TTS_MAX_CONNECTIONS", "TTS_MAX_CONNECTIONS_PER_CLIENT"):
        monkeypatch.delenv(name, raising=False)
    assert load_settings().max_connections_per_client == 64
    monkeypatch.setenv("TTS_MAX_CONNECTIONS", "20")  # alone: the queue and the per-client cap follow it down
    alone = load_settings()
    assert (alone.max_connections_per_client, alone.max_concurrent, alone.max_queue) == (20, 16, 3)
    monkeypatch.setenv("TTS_MAX_CONCURRENT", "4")
    monkeypatch.setenv("TTS_MAX_QUEUE", "4")
    assert load_settings().max_connections_per_client == 20
    monkeypatch.setenv("TTS_MAX_CONNECTIONS_PER_CLIENT", "8")
    assert load_settings().max_connections_per_client == 8
    monkeypatch.setenv("TTS_MAX_CONNECTIONS_PER_CLIENT", "21")
    with pytest.raises(SettingsError, match="TTS_MAX_CONNECTIONS_PER_CLIENT must not exceed"):
        load_settings()


def test_the_upload_byte_limit_is_derived_from_the_duration_limit_unless_set(monkeypatch: pytest.MonkeyPatch) -> None:
    assert load_settings().voice_upload_max_bytes == 60 * 384_000 + 1024 * 1024  # 60 s of 48 kHz stereo float32
    monkeypatch.setenv("TTS_VOICE_UPLOAD_MAX_SECONDS", "120")
    derived = load_settings()
    assert derived.voice_upload_max_bytes == 120 * 384_000 + 1024 * 1024
    assert derived.voice_upload_inflight_bytes == derived.voice_upload_max_bytes  # above the 32 MiB default
    monkeypatch.setenv("TTS_VOICE_UPLOAD_MAX_BYTES", str(8 * 1024 * 1024))
    assert load_settings().voice_upload_max_bytes == 8 * 1024 * 1024


def test_upload_bytes_in_flight_must_hold_one_largest_upload(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TTS_VOICE_UPLOAD_MAX_BYTES", str(8 * 1024 * 1024))
    monkeypatch.setenv("TTS_VOICE_UPLOAD_INFLIGHT_BYTES", str(4 * 1024 * 1024))
    with pytest.raises(SettingsError, match="TTS_VOICE_UPLOAD_INFLIGHT_BYTES must be at least"):
        load_settings()


# --- the .env file --------------------------------------------------------------------------------------------
def test_a_dotenv_file_in_the_working_directory_is_read_below_the_environment_and_the_flags(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # Other programs' lines (a container's) are not ours and stay unread; comments and quotes as in a shell.
    (tmp_path / ".env").write_text(
        "# the server\nTTS_PORT=9001\nTTS_PROFILES_DIR='voices from dotenv'\nCUDA_VISIBLE_DEVICES=1\nHOME=/x\n"
    )
    s = load_settings()
    assert (s.port, s.profiles_dir) == (9001, Path("voices from dotenv"))
    monkeypatch.setenv("TTS_PORT", "9002")  # the environment wins over the file, for that variable only
    s = load_settings()
    assert (s.port, s.profiles_dir) == (9002, Path("voices from dotenv"))
    assert load_settings(port=9003, flags={"port": "--port"}).port == 9003  # a flag wins over both
    assert load_settings(env_file=None).profiles_dir == Path("voice_profiles")  # no file: the default


def test_another_env_file_replaces_the_one_in_the_working_directory(tmp_path: Path) -> None:
    (tmp_path / ".env").write_text("TTS_PORT=9001\nTTS_LOG_FORMAT=json\n")
    other = tmp_path / "conf" / "server.env"
    other.parent.mkdir()
    other.write_text("TTS_PORT=9100\n")
    s = load_settings(env_file=other)
    assert (s.port, s.log_format) == (9100, "text")


@pytest.mark.parametrize(
    ("lines", "expected"),
    [
        ("TTS_PORT=eighty\n", "invalid configuration: TTS_PORT='eighty' (in .env): Input should be a valid integer"),
        # A misspelt variable in the file is an error, not silence: TTS_API_KEY would leave the server open.
        ("TTS_API_KEY=secret-key-123\n", "invalid configuration: TTS_API_KEY (in .env): no such setting"),
    ],
)
def test_a_bad_line_of_the_dotenv_file_names_the_variable_and_the_file(
    tmp_path: Path, lines: str, expected: str
) -> None:
    (tmp_path / ".env").write_text(lines)
    with pytest.raises(SettingsError) as info:
        load_settings()
    assert str(info.value).startswith(expected)
    assert "secret-key" not in str(info.value)


def test_a_bad_flag_value_names_the_flag_as_typed() -> None:
    with pytest.raises(SettingsError) as info:
        load_settings(port=0, flags={"port": "--port"})
    assert str(info.value) == "invalid configuration: --port 0: Input should be greater than or equal to 1"


# --- the API keys file ------------------------------------------------------------------------------------------
def test_the_api_keys_file_adds_its_keys_to_those_of_the_variable(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    keys = tmp_path / "keys"
    keys.write_text("# one key a line\nkey-from-file-1\n\n  key-from-file-2  \n")
    monkeypatch.setenv("TTS_API_KEYS", "key-from-env-1")
    monkeypatch.setenv("TTS_API_KEYS_FILE", str(keys))
    s = load_settings()
    assert [k.get_secret_value() for k in s.api_keys] == ["key-from-env-1", "key-from-file-1", "key-from-file-2"]
    assert s.public_dict()["api_keys"] == 3


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        (None, "cannot read the file (No such file or directory)"),
        ("long-enough-key\nshort\n", "line 2: each API key must be at least 8 characters"),
        ("# only a comment\n\n", "the file holds no key (an empty file would leave the server without authentication)"),
    ],
)
def test_an_unusable_api_keys_file_stops_startup_naming_it(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, content: str | None, expected: str
) -> None:
    if content is not None:
        (tmp_path / "keys").write_text(content)
    monkeypatch.setenv("TTS_API_KEYS_FILE", "keys")  # relative to the working directory, tmp_path
    with pytest.raises(SettingsError) as info:
        load_settings()
    assert str(info.value) == f"invalid configuration: TTS_API_KEYS_FILE='keys': {expected}"
    assert "long-enough-key" not in str(info.value)


def test_unknown_tts_variables_are_reported() -> None:
    env = {"TTS_MAX_CONCURENT": "4", "TTS_PORT": "1", "HOME": "/root"}
    assert unknown_env_vars(env) == ["TTS_MAX_CONCURENT"]


def test_the_settings_import_no_kernel() -> None:
    """The server's settings (and the interface and FastPath under them) import neither Triton nor a kernel module."""
    import subprocess
    import sys

    code = (
        "import sys, tts_server.settings; "
        "mods = [m for m in sys.modules if m == 'triton' or m.startswith('triton.') or "
        "(m.startswith('qwen_tts.fastpath.') and m != 'qwen_tts.fastpath.options')]; print(mods)"
    )
    root = Path(__file__).resolve().parents[1]
    out = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout
