"""The distribution ships every module and the entry points (built as a real wheel)."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[2]


def source_packages() -> set[str]:
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    mapping = pyproject["tool"]["setuptools"]["package-dir"]
    found = set()
    for package, folder in mapping.items():
        for init in (ROOT / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / folder)
            found.add(".".join([package, *rel.parts]) if rel.parts else package)
    return found


def test_every_package_directory_is_listed():
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    assert source_packages() <= listed, source_packages() - listed


def test_wheel_contents_and_entry_points(tmp_path):
    # built from a copy: ci/test.sh runs this file in several lanes at once, and setuptools writes build/
    # and *.egg-info/ into the tree it builds
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    for folder in ("overlay", "build_stubs"):
        shutil.copytree(ROOT / folder, src / folder, ignore=shutil.ignore_patterns("__pycache__"))
    wheel_cmd = [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(tmp_path)]
    subprocess.run([*wheel_cmd, str(src)], check=True, capture_output=True)
    wheel = next(tmp_path.glob("hybrid_exl3_fixes-*.whl"))
    names = set(zipfile.ZipFile(wheel).namelist())
    for module in (
        "hybrid_exl3_fixes/__init__.py",
        "hybrid_exl3_fixes/registry.py",
        "hybrid_exl3_fixes/cli.py",
        "hybrid_exl3_fixes/doctor/__init__.py",
        "hybrid_exl3_fixes/checkpoint/codec.py",
        "hybrid_exl3_fixes/decisions/p8_kernel_choice.py",
        "hybrid_exl3_fixes/doctor/memory/arithmetic.py",
        "hybrid_exl3_fixes/shared.py",
        "hybrid_exl3_fixes/checkpoint/tiny.py",
        "hybrid_exl3_fixes/checkpoint/tinyspec.py",
        "hybrid_exl3_fixes/build_stubs/builder.py",
        "hybrid_exl3_fixes/aphrodite/model_executor/layers/quantization/exl3/__init__.py",
        "hybrid_exl3_fixes/aphrodite/model_executor/layers/quantization/exl3/p10_moe_context.py",
        "hybrid_exl3_fixes/aphrodite/lora/layers/utils.py",
        "hybrid_exl3_fixes/aphrodite/lora/layers/base_linear.py",
    ):
        assert module in names, module
    entry_points = next(n for n in names if n.endswith("entry_points.txt"))
    text = zipfile.ZipFile(wheel).read(entry_points).decode()
    assert "[aphrodite.general_plugins]\nhybrid_exl3_fixes = hybrid_exl3_fixes:register" in text
    assert "hybrid-exl3-fixes = hybrid_exl3_fixes.cli:main" in text
