"""`qwen3-tts-server`: the server's command line.

The common settings have flags; every setting is also a `TTS_*` variable, from the environment or a `.env` file.
Flags override the environment, which overrides the `.env` file, which overrides the defaults: the flags given are
handed to the one settings type (`ServerSettings`) as its arguments, the file goes to its pydantic-settings env_file.
Exit status: 0 after a clean shutdown, 1 startup failed (one `startup failed:` line), 2 bad configuration or usage,
3 the engine failed and could not be restarted in this process (let the supervisor restart it).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, get_args

from .settings import ENV_FILE, ENV_PREFIX, ServerSettings, SettingsError, load_settings

COMMAND = "qwen3-tts-server"
EXIT_USAGE = 2

# Flag -> the setting it gives, with its help. The rest of the settings are variables only (listed by --help).
FLAGS: dict[str, tuple[str, str]] = {
    "--host": ("host", "address to listen on (0.0.0.0: every interface)"),
    "--port": ("port", "port to listen on"),
    "--model": ("model_path", "checkpoint folder, hub id in the local Hugging Face cache, or 'demo'"),
    "--profiles-dir": ("profiles_dir", "folder of voice profiles (<name>.safetensors)"),
    "--api-keys-file": ("api_keys_file", "file of Bearer API keys, one a line; without keys no authentication"),
    "--device": ("device", "auto, cpu, cuda, cuda:N or mps"),
    "--api-processes": ("api_processes", "HTTP front-end processes beside one engine process (0: one process)"),
    "--log-level": ("log_level", "the least severe records logged"),
    "--log-format": ("log_format", "json: one JSON object per line (time, level, logger, message, request_id)"),
}
_TYPES: dict[str, Any] = {"port": int, "api_processes": int, "profiles_dir": Path, "api_keys_file": Path}


def program_name(command: str = COMMAND) -> str:
    """How this process was started, for usage lines (the tools' too): the installed command's name (or a
    script's), or `python -m MODULE` where it was run with -m (argparse would show the module's file name);
    `command` where there is no name to go by."""
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    if spec is not None and spec.name:
        return f"python -m {spec.name.removesuffix('.__main__')}"
    return os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else command


def _variables() -> str:
    """Every TTS_* variable with its default, for the epilog: the help is the reference an installed server has."""
    lines = []
    for name, field in ServerSettings.model_fields.items():
        default = field.get_default(call_default_factory=True)
        shown = "unset" if default is None or default == [] else str(default)
        lines.append(f"  {ENV_PREFIX}{name.upper()} (default: {shown})")
    return "\n".join(lines)


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog or program_name(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=(
            "Qwen3-TTS voice-cloning HTTP server: OpenAI-compatible /v1/audio/speech, /synthesize,\n"
            "/health, /ready, /metrics. With no --model the built-in tiny demo checkpoint and its\n"
            "voice 'demo' are served."
        ),
        epilog=(
            f"Every setting is a {ENV_PREFIX}* variable, read from the environment or from a .env file (one\n"
            "VARIABLE=value a line) in the working directory or named by --env-file. A flag overrides the\n"
            "environment, which overrides the .env file, which overrides the default.\n\n"
            "Exit status: 0 stopped cleanly (SIGTERM drains in-flight requests first); 1 startup failed (one\n"
            "'startup failed:' line says why: a port in use, a model that cannot be loaded); 2 bad configuration\n"
            "or usage; 3 the engine failed and could not be restarted in this process (restart the server).\n\n"
            f"Variables:\n{_variables()}"
        ),
    )
    for flag, (field, text) in FLAGS.items():
        info = ServerSettings.model_fields[field]
        choices = get_args(info.annotation) if field in ("log_level", "log_format") else None
        default = info.get_default(call_default_factory=True)
        parser.add_argument(
            flag,
            dest=field,
            type=_TYPES.get(field, str),
            choices=choices,
            default=argparse.SUPPRESS,  # not given: the environment, the .env file or the default decides
            metavar=None if choices else field.split("_")[-1].upper(),
            help=f"{text} ({ENV_PREFIX}{field.upper()}; default: {'unset' if default is None else default})",
        )
    parser.add_argument(
        "--env-file",
        type=Path,
        default=None,
        metavar="PATH",
        help=f"read {ENV_PREFIX}* variables from this file instead of ./{ENV_FILE}",
    )
    return parser


def settings_from_args(args: argparse.Namespace) -> ServerSettings:
    """The settings: the flags given, over the environment, over the .env file, over the defaults."""
    given = vars(args)
    env_file = given.pop("env_file")
    if env_file is not None and not env_file.is_file():
        raise SettingsError(f"invalid configuration: --env-file {env_file}: no such file")
    flag_of = {field: flag for flag, (field, _) in FLAGS.items()}
    return load_settings(
        env_file=env_file if env_file is not None else ENV_FILE,
        flags={field: flag_of[field] for field in given},
        **given,
    )


def main(argv: Sequence[str] | None = None) -> int:
    """The console script `qwen3-tts-server` (and `python inference_server.py`)."""
    args = build_parser().parse_args(argv)
    try:
        settings = settings_from_args(args)
    except SettingsError as e:
        print(e, file=sys.stderr)
        return EXIT_USAGE
    from .serve import run  # uvicorn, the app and the engine: only once there is something to serve

    return run(settings)


if __name__ == "__main__":
    sys.exit(main())
