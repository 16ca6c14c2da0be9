"""The vLLM-Omni deploy configs hold only keys that vLLM-Omni or vLLM read (checked in the vLLM-Omni environment,
against the installed versions' own classes and sources)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import yaml

from server_helpers import REPO_ROOT, VO_PYTHON, needs_vllm_omni

CONFIGS = ["stage_config_optimized.yaml", "stage_config_cpu.yaml"]
needs_env = needs_vllm_omni()


def _check(*paths: str | Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(VO_PYTHON), "-m", "qwen_tts.engines.vllm_omni.config_keys", *map(str, paths)],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )


@needs_env
def test_every_key_of_our_deploy_configs_is_read_by_some_code(tmp_path: Path) -> None:
    # The checker must catch what it is for: keys vLLM-Omni 0.30 ignores silently (the first three appear in its
    # own packaged Qwen3-TTS config), a sampling key vLLM does not have, a misspelt stage key.
    stale = yaml.safe_load((REPO_ROOT / "stage_config_cpu.yaml").read_text())
    stale["connectors"]["connector_of_shared_memory"]["extra"].update(
        {"connector_get_sleep_s": 0.01, "connector_get_max_wait": 300}
    )
    stale["stages"][0]["default_sampling_params"]["max_new_tokens"] = 2048
    stale["stages"][1]["max_num_seq"] = 4
    bad = tmp_path / "stale.yaml"
    bad.write_text(yaml.safe_dump(stale))

    r = _check(*CONFIGS, bad)
    lines = [line for line in r.stdout.splitlines() if line.endswith("is read by no code")]  # vLLM logs to stdout too
    assert r.returncode == 1
    assert sorted(lines) == sorted(
        f"{bad}: {key} is read by no code"
        for key in (
            "connectors.connector_of_shared_memory.extra.connector_get_sleep_s",
            "connectors.connector_of_shared_memory.extra.connector_get_max_wait",
            "stages[0].default_sampling_params.max_new_tokens",
            "stages[1].max_num_seq",
        )
    ), r.stdout + r.stderr  # and nothing from our own two configs


def test_both_configs_share_the_stage_layout() -> None:
    opt, cpu = (yaml.safe_load((REPO_ROOT / name).read_text()) for name in CONFIGS)
    assert [s["stage_id"] for s in opt["stages"]] == [s["stage_id"] for s in cpu["stages"]] == [0, 1]
    for c in (opt, cpu):
        extra = c["connectors"]["connector_of_shared_memory"]["extra"]
        assert extra["codec_chunk_frames"] == 12
        assert extra["codec_left_context_frames"] >= 72  # the decoder's attention window
        assert 1 <= extra["initial_codec_chunk_frames"] < extra["codec_chunk_frames"]
    assert opt["dtype"] == "bfloat16" and cpu["dtype"] == "float32"


def test_backend_options_reach_the_vllm_omni_config_and_unknown_ones_are_refused(tiny_checkpoint: Path) -> None:
    """The backend's own options come through EngineSettings.backend_options (no vLLM-Omni needed to check them)."""
    from qwen_tts.engine_api import EngineSettings, EngineSettingsError
    from qwen_tts.engines.vllm_omni import engine as vo

    settings = EngineSettings(model_path=str(tiny_checkpoint), backend="vllm-omni", backend_options={"stage_conf": "x"})
    with pytest.raises(EngineSettingsError, match=r"unknown vllm-omni option\(s\) \['stage_conf'\]") as e:
        vo.VllmOmniEngine.from_settings(settings)
    assert e.value.setting == "backend_options"
    options = {"stage_config": None, "speaker_transport": "fast"}
    with pytest.raises(EngineSettingsError, match="speaker_transport must be auto, tensor or list") as e:
        vo.VllmOmniEngine.from_settings(EngineSettings(model_path=str(tiny_checkpoint), backend_options=options))
    assert e.value.setting == "backend_options.speaker_transport"
    assert set(vo.BACKEND_OPTIONS) <= {f for f in vo.VllmOmniConfig.__dataclass_fields__}
