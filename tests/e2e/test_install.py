"""Installs work as users install: a built wheel in a fresh venv runs the README quick start.

The venv reuses the packages of the interpreter running the suite (torch and friends), wherever
they are installed: a venv of its own, a user site, the base interpreter. ``--system-site-packages``
would see only the base interpreter's, so the running interpreter's site directories are
listed in a ``.pth`` file of the new venv, after its own site-packages. driftscope itself must
come from the wheel: the editable install of the checkout sits in those packages too, so the
test checks that the venv's copy shadows it, from a temporary working directory and without
``PYTHONPATH``. With ``CI=true`` nothing here skips,
so a C kernel that did not build (the extension is optional for users without a compiler)
fails CI instead of silently skipping every kernel test.
"""

from __future__ import annotations

import importlib.metadata
import os
import re
import shutil
import site
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT

IN_CI = os.environ.get("CI", "").strip().lower() in ("1", "true", "yes")
_NOT_SOURCE = shutil.ignore_patterns(
    ".git", "build", "dist", "*.egg-info", "__pycache__", "*.so", "dumps", "node_modules", ".pytest_cache", "out"
)


def quick_start_commands() -> list[str]:
    """The README's quick start, less its ``pip install`` steps: what a user runs once it is installed."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    section = readme[readme.index("## Quick start") :]
    block = re.search(r"```bash\n(.*?)\n```", section, re.S)
    assert block, "README.md: no bash block under '## Quick start'"
    steps = [s.strip() for s in block[1].split("&&")]
    return [s for s in steps if not s.startswith("pip ")]


def _run(cmd: list[str] | str, **kw) -> subprocess.CompletedProcess[str]:
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, **kw)
    assert r.returncode == 0, f"{cmd}: exit {r.returncode}\n{r.stdout[-2000:]}\n{r.stderr[-4000:]}"
    return r


def _have_build_backend() -> bool:
    """Whether this interpreter has the ``[build-system]`` setuptools (>= 74, for ``ext-modules`` in pyproject)."""
    try:
        major = int(importlib.metadata.version("setuptools").split(".")[0])
    except (importlib.metadata.PackageNotFoundError, ValueError):
        return False
    return major >= 74


@pytest.fixture(scope="module")
def venv(tmp_path_factory) -> Path:
    """A fresh venv with driftscope installed from a wheel built from a copy of this checkout."""
    tmp = tmp_path_factory.mktemp("install")
    src = tmp / "src"
    shutil.copytree(ROOT, src, ignore=_NOT_SOURCE)  # build outside the checkout: no build/ or egg-info in it
    isolation = ["--no-build-isolation"] if _have_build_backend() else []  # offline here; CI may fetch it
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", *isolation, "-w", str(tmp / "wheels"), str(src)])
    wheel = next((tmp / "wheels").glob("driftscope-*.whl"))
    env_dir = tmp / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", str(env_dir)])
    _see_running_packages(env_dir)
    _run(
        [
            sys.executable,
            "-m",
            "pip",
            "--python",
            str(env_dir / "bin" / "python"),
            "install",
            "-q",
            "--no-deps",
            "--no-index",
            str(wheel),
        ]
    )
    return env_dir


def running_site_dirs() -> list[str]:
    """The site-packages folders the interpreter running the suite sees (a venv's own, the base's where the venv
    has system site packages, the user site), in its own order."""
    dirs = [p for p in sys.path if os.path.basename(p) in ("site-packages", "dist-packages")]
    dirs += site.getsitepackages() + ([site.getusersitepackages()] if site.ENABLE_USER_SITE else [])
    return [d for d in dict.fromkeys(dirs) if os.path.isdir(d)]


def _see_running_packages(env_dir: Path) -> None:
    """List :func:`running_site_dirs` in a ``.pth`` of the venv: plain paths, so their own ``.pth`` hooks
    (the checkout's editable-install finder among them) do not run, and after the venv's site-packages."""
    (own,) = _run(
        [str(env_dir / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"]
    ).stdout.split()
    (Path(own) / "zz_running_interpreter.pth").write_text("".join(f"{d}\n" for d in running_site_dirs()))


def _venv_env(venv: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "DRIFTSCOPE_DUMP_DIR")}
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"  # `python` is the venv's
    return env


def _probe(venv: Path, cwd: Path, code: str) -> list[str]:
    return _run(["python", "-c", code], cwd=cwd, env=_venv_env(venv)).stdout.splitlines()


def _in_venv(path: str, venv: Path) -> bool:
    return Path(path).resolve().is_relative_to(venv.resolve())


@pytest.mark.slow
def test_wheel_install_shadows_the_checkout_and_ships_configs_and_kernel(venv, tmp_path):
    init, preset, kernel = _probe(
        venv,
        tmp_path,
        (
            "import dumper, comparator.hidden.kernels as k; from dumper.resources import config_path; "
            "print(dumper.__file__); print(config_path('tiny-llama.json')); "
            "print(k._kernels.__file__ if k.HAVE_EXTENSION else 'no kernel')"
        ),
    )
    assert _in_venv(init, venv), f"dumper imported from {init}, not from the wheel"
    assert _in_venv(preset, venv) and Path(preset).is_file(), preset
    from comparator.hidden.kernels import HAVE_EXTENSION

    if IN_CI or HAVE_EXTENSION:  # a machine that built the kernel for the checkout must build it for the wheel
        assert kernel != "no kernel" and _in_venv(kernel, venv), kernel


@pytest.mark.slow
def test_wheel_finds_the_logprob_threshold_table(venv, tmp_path):
    (table,) = _probe(
        venv, tmp_path, "from comparator.judging.logprob_thresholds import THRESHOLD_TABLE; print(THRESHOLD_TABLE)"
    )
    assert _in_venv(table, venv) and Path(table).is_file(), f"{table}: not shipped where the comparator looks"


@pytest.mark.slow
def test_readme_quick_start_runs_from_the_wheel(venv, tmp_path):
    commands = quick_start_commands()
    assert any("python -m comparator" in c for c in commands), commands
    r = _run(["bash", "-c", "set -e; " + " && ".join(commands)], cwd=tmp_path, env=_venv_env(venv))
    assert "PASS" in r.stdout and (tmp_path / "dumps" / "sdpa" / "manifest.json").is_file(), r.stdout


def test_c_kernel_is_built(request):
    """CI fails when the optional C extension did not build (every kernel test would skip)."""
    try:
        import comparator._kernels  # noqa: F401
    except ImportError as e:
        if IN_CI:
            pytest.fail(f"comparator._kernels did not build ({e}); CI needs the C kernel")
        pytest.skip(f"comparator._kernels not built ({e}); the numpy fallback is in use")
