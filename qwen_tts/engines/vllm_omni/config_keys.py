"""Which keys of a vLLM-Omni deploy config no code reads (run in the vLLM-Omni environment).

    python -m qwen_tts.engines.vllm_omni.config_keys stage_config_optimized.yaml stage_config_cpu.yaml

vLLM-Omni passes unknown stage keys on to vLLM's engine arguments, which drop the ones they do not declare, and
connector extras are read with dict.get: a misspelt or stale key is silently ignored. This walks a config and
checks each key against what vLLM-Omni and vLLM actually consume:

- top level: fields of vLLM-Omni's DeployConfig;
- stages[i]: fields of StageDeployConfig, its reserved keys, or fields of OmniEngineArgs (vLLM's EngineArgs);
- stages[i].default_sampling_params: fields of vllm.SamplingParams;
- stages[i].subtalker_sampling_params: keys the Qwen3-TTS talker reads;
- stages[i].output_connectors / input_connectors: to_stage_N / from_stage_N naming a connector defined here;
- connectors.<alias>: name and extra; extra keys: quoted in vLLM-Omni's source (its connector and stage input code
  read them by name).
Exit status 1 (and one line per key) when any key is read by nothing.
"""

from __future__ import annotations

import dataclasses
import re
import sys
from functools import cache
from pathlib import Path
from typing import Any

import yaml


@cache
def _omni_source() -> str:
    import vllm_omni

    root = Path(vllm_omni.__file__).parent
    return "\n".join(p.read_text(encoding="utf-8", errors="replace") for p in root.rglob("*.py"))


def _quoted_in_omni(key: str) -> bool:
    return re.search(rf"[\"']{re.escape(key)}[\"']", _omni_source()) is not None


@cache
def _fields() -> dict[str, frozenset[str]]:
    from vllm import SamplingParams
    from vllm_omni.config import stage_config as sc
    from vllm_omni.engine.arg_utils import OmniEngineArgs
    from vllm_omni.model_executor.models.qwen3_tts import qwen3_tts_talker

    talker_src = Path(qwen3_tts_talker.__file__).read_text(encoding="utf-8")
    subtalker = frozenset(re.findall(r"subtalker_params\.get\(\s*[\"'](\w+)[\"']", talker_src))
    return {
        "deploy": frozenset(f.name for f in dataclasses.fields(sc.DeployConfig)),
        "stage": frozenset(f.name for f in dataclasses.fields(sc.StageDeployConfig))
        | frozenset(sc._STAGE_RESERVED_KEYS)
        | frozenset(f.name for f in dataclasses.fields(OmniEngineArgs)),
        "sampling": frozenset(getattr(SamplingParams, "__struct_fields__", ()))
        | (
            frozenset(f.name for f in dataclasses.fields(SamplingParams))
            if dataclasses.is_dataclass(SamplingParams)
            else frozenset()
        ),
        "subtalker": subtalker,
    }


def unread_keys(config: dict[str, Any]) -> list[str]:
    """Dotted paths of the keys in `config` that no code reads."""
    f = _fields()
    bad: list[str] = []
    connectors = config.get("connectors") or {}
    for key in config:
        if key not in f["deploy"]:
            bad.append(key)
    for alias, spec in connectors.items():
        for key, value in (spec or {}).items():
            if key not in ("name", "extra"):
                bad.append(f"connectors.{alias}.{key}")
            elif key == "extra":
                bad.extend(f"connectors.{alias}.extra.{k}" for k in value or {} if not _quoted_in_omni(k))
    for i, stage in enumerate(config.get("stages") or []):
        where = f"stages[{i}]"
        for key, value in stage.items():
            if key not in f["stage"]:
                bad.append(f"{where}.{key}")
            elif key == "default_sampling_params":
                bad.extend(f"{where}.{key}.{k}" for k in value or {} if k not in f["sampling"])
            elif key == "subtalker_sampling_params":
                bad.extend(f"{where}.{key}.{k}" for k in value or {} if k not in f["subtalker"])
            elif key in ("output_connectors", "input_connectors"):
                pattern = r"to_stage_\d+" if key == "output_connectors" else r"from_stage_\d+"
                for k, ref in (value or {}).items():
                    if not re.fullmatch(pattern, k) or ref not in connectors:
                        bad.append(f"{where}.{key}.{k}")
    return bad


def main(argv: list[str]) -> int:
    status = 0
    for name in argv:
        config = yaml.safe_load(Path(name).read_text(encoding="utf-8")) or {}
        for key in unread_keys(config):
            print(f"{name}: {key} is read by no code")
            status = 1
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
