"""The command lines: `qwen3-tts-server` (tts_server/cli.py) maps its flags onto the one settings type, over the
environment and the .env file; every command's --help names the command that was run."""

from __future__ import annotations

import subprocess
import sys
import types
from pathlib import Path

import pytest

from tts_server import cli
from tts_server.settings import ServerSettings, SettingsError
from tts_tools import batch, extract

REPO = Path(__file__).resolve().parents[1]


# No TTS_* variable and a working directory of the test's own (conftest.clean_tts_env).
pytestmark = pytest.mark.usefixtures("clean_tts_env")


def settings(*argv: str) -> ServerSettings:
    return cli.settings_from_args(cli.build_parser("qwen3-tts-server").parse_args(argv))


def test_each_flag_sets_its_setting(tmp_path: Path) -> None:
    (tmp_path / "keys").write_text("key-from-file-1\n")
    s = settings(
        "--host", "127.0.0.1", "--port", "9100", "--model", "/models/qwen", "--profiles-dir", "voices",
        "--api-keys-file", "keys", "--device", "CPU", "--log-level", "debug", "--log-format", "json",
    )  # fmt: skip
    assert (s.host, s.port, s.model_path, s.profiles_dir, s.device) == (
        "127.0.0.1",
        9100,
        "/models/qwen",
        Path("voices"),
        "cpu",
    )
    assert (s.api_keys_file, [k.get_secret_value() for k in s.api_keys]) == (Path("keys"), ["key-from-file-1"])
    assert (s.log_level, s.log_format) == ("debug", "json")
    assert settings() == ServerSettings(_env_file=None)  # no flag, no variable, no file: the defaults


def test_flags_override_the_environment_which_overrides_the_dotenv_file(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    (tmp_path / ".env").write_text("TTS_PORT=9001\nTTS_HOST=10.0.0.1\nTTS_LOG_FORMAT=json\n")
    monkeypatch.setenv("TTS_PORT", "9002")
    monkeypatch.setenv("TTS_HOST", "127.0.0.2")
    s = settings("--port", "9100")
    assert (s.port, s.host, s.log_format) == (9100, "127.0.0.2", "json")  # flag, variable, file
    assert settings().port == 9002


def test_env_file_names_another_file_instead_of_the_working_directorys(tmp_path: Path) -> None:
    (tmp_path / ".env").write_text("TTS_PORT=9001\nTTS_LOG_FORMAT=json\n")
    (tmp_path / "prod.env").write_text("TTS_PORT=9200\n")
    s = settings("--env-file", str(tmp_path / "prod.env"))
    assert (s.port, s.log_format) == (9200, "text")
    with pytest.raises(SettingsError, match=r"^invalid configuration: --env-file missing.env: no such file$"):
        settings("--env-file", "missing.env")


@pytest.mark.parametrize(
    ("argv", "line"),
    [
        (["--port", "0"], "invalid configuration: --port 0: Input should be greater than or equal to 1"),
        (["--device", "gpu"], "invalid configuration: --device gpu: must be auto, cpu, cuda, cuda:N or mps"),
        (["--api-keys-file", "nokeys"], "invalid configuration: --api-keys-file nokeys: cannot read the file"),
    ],
)
def test_a_bad_flag_value_exits_2_with_one_line_naming_the_flag(
    argv: list[str], line: str, capsys: pytest.CaptureFixture
) -> None:
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(line) and err.count("\n") == 1


def test_an_unknown_flag_or_a_bad_choice_is_a_usage_error(capsys: pytest.CaptureFixture) -> None:
    for argv in (["--prot", "80"], ["--log-format", "xml"], ["--port", "eighty"]):
        with pytest.raises(SystemExit) as info:
            cli.main(argv)
        assert info.value.code == 2
    err = capsys.readouterr().err
    assert "unrecognized arguments: --prot 80" in err
    assert "argument --log-format: invalid choice: 'xml'" in err
    assert "argument --port: invalid int value: 'eighty'" in err


# --- --help -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("command", "build"),
    [
        ("qwen3-tts-server", cli.build_parser),
        ("qwen3-tts-extract", extract.build_parser),
        ("qwen3-tts-batch", batch.build_parser),
    ],
)
def test_help_names_the_installed_command(monkeypatch: pytest.MonkeyPatch, command: str, build) -> None:
    """As a console script runs: argv[0] is the command's path and __main__ is a script, not a -m module."""
    monkeypatch.setattr(sys, "argv", [f"/opt/venv/bin/{command}", "--help"])
    monkeypatch.setitem(sys.modules, "__main__", types.ModuleType("__main__"))
    text = build().format_help()
    assert text.startswith(f"usage: {command} [-h]")
    for shipped_elsewhere in ("inference_server.py", "batch_inference.py", "extract_speaker_embedding.py", "docs/"):
        assert shipped_elsewhere not in text  # a name or a repository path the installed wheel does not have


def test_the_server_help_lists_its_flags_every_variable_and_the_exit_codes() -> None:
    text = cli.build_parser("qwen3-tts-server").format_help()
    for flag in ("--host", "--port", "--model", "--profiles-dir", "--api-keys-file", "--device", "--log-level",
                 "--log-format", "--env-file"):  # fmt: skip
        assert f"  {flag} " in text
    for name in ServerSettings.model_fields:
        assert f"TTS_{name.upper()} " in text
    assert "--port PORT           port to listen on (TTS_PORT; default: 8090)" in text
    assert "1 startup failed" in text and "3 the engine failed" in text


def test_the_tools_main_functions_are_the_console_scripts_entry_points() -> None:
    """pyproject's qwen3-tts-extract = "tts_tools.extract:main" and qwen3-tts-batch = "tts_tools.batch:main"."""
    for main in (extract.main, batch.main, cli.main):
        with pytest.raises(SystemExit) as info:
            main(["--help"])
        assert info.value.code == 0


@pytest.mark.parametrize(
    ("argv", "usage"),
    [
        (["inference_server.py"], "usage: inference_server.py [-h]"),
        (["-m", "tts_server.cli"], "usage: python -m tts_server.cli [-h]"),
        (["-m", "extract_speaker_embedding"], "usage: python -m extract_speaker_embedding [-h]"),
    ],
)
def test_help_names_the_script_or_module_that_was_run(argv: list[str], usage: str) -> None:
    done = subprocess.run([sys.executable, *argv, "--help"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(usage)
