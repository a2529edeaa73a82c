"""The libcuda stub builder with the real gcc and readelf, on fake NVIDIA / conda-forge / WSL roots."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from hybrid_exl3_fixes.build_stubs import BuildError, build_stubs, cuda_prefixes, find_cuda_headers
from hybrid_exl3_fixes.build_stubs.builder import driver_symbols

pytestmark = pytest.mark.skipif(
    not (shutil.which("gcc") and shutil.which("readelf")), reason="needs gcc and readelf (apt-get install gcc binutils)"
)
SYSTEM_PATH = "/usr/bin:/bin"
REAL_HEADERS = find_cuda_headers(cuda_prefixes(dict(os.environ), Path("/")), Path("/"))
needs_header = pytest.mark.skipif(
    not REAL_HEADERS, reason="no real cuda.h here (CUDA toolkit, nvidia-cuda-runtime or triton)"
)


def make_lib(path: Path, soname: str, cuinit_returns: int = 34) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    src = path.parent / f".{path.name}.c"
    src.write_text(f"int cuInit(unsigned int f) {{ return {cuinit_returns}; }}\n")
    subprocess.run(["gcc", "-shared", "-fPIC", f"-Wl,-soname,{soname}", "-o", str(path), str(src)], check=True)
    src.unlink()
    return path


def env(**extra: str) -> dict[str, str]:
    return {"PATH": SYSTEM_PATH, "HOME": os.environ.get("HOME", "/root"), **extra}


def test_nvidia_layout_finds_the_toolkit_stub(tmp_path):
    root = tmp_path / "root"
    stub = make_lib(root / "usr/local/cuda-12.4/targets/x86_64-linux/lib/stubs/libcuda.so", "libcuda.so.1")
    (root / "usr/local/cuda").symlink_to(root / "usr/local/cuda-12.4")
    result = build_stubs(tmp_path / "out", root=root, env=env())
    assert result.source.startswith(f"copied from {root}/usr/local/cuda")
    assert (tmp_path / "out" / "libcuda.so").read_bytes() == stub.read_bytes()
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["env.sh", "libcuda.so", "manifest.json"]


def test_conda_forge_layout_lib_stubs(tmp_path):
    root = tmp_path / "root"
    make_lib(root / "opt/conda/lib/stubs/libcuda.so", "libcuda.so.1")
    (root / "opt/conda/include").mkdir(parents=True)
    result = build_stubs(tmp_path / "out", root=root, env=env(CONDA_PREFIX="/opt/conda"))
    assert "CONDA_PREFIX" in result.source and "lib/stubs" in result.source


def test_wrong_soname_and_wrong_machine_are_rejected(tmp_path):
    root = tmp_path / "root"
    make_lib(root / "opt/cuda/lib/stubs/libcuda.so", "libfoo.so.1")  # CUDA_HOME comes first in order
    arm = root / "opt/cuda/targets/x86_64-linux/lib/stubs/libcuda.so"
    arm.parent.mkdir(parents=True)
    arm.write_bytes(b"\x7fELF\x02\x01\x01" + b"\0" * 11 + (183).to_bytes(2, "little") + b"\0" * 44)  # aarch64
    good = make_lib(root / "opt/conda/lib/stubs/libcuda.so", "libcuda.so.1")
    result = build_stubs(tmp_path / "out", root=root, env=env(CUDA_HOME="/opt/cuda", CONDA_PREFIX="/opt/conda"))
    assert result.source.startswith(f"copied from {good}")
    reasons = {str(c.path.relative_to(root)): c.reason for c in result.rejected}
    assert "libfoo.so.1" in reasons["opt/cuda/lib/stubs/libcuda.so"]
    assert "not x86-64" in reasons["opt/cuda/targets/x86_64-linux/lib/stubs/libcuda.so"]


def test_bad_stub_where_flashinfer_looks_first_fails_the_self_check(tmp_path):
    # flashinfer links -L$CUDA_HOME/lib64/stubs before FLASHINFER_EXTRA_LDFLAGS: a wrong stub
    # there wins the link whatever env.sh says, so the builder must refuse and say where it is.
    root = tmp_path / "root"
    make_lib(root / "opt/cuda/lib64/stubs/libcuda.so", "libfoo.so.1")
    make_lib(root / "opt/conda/lib/stubs/libcuda.so", "libcuda.so.1")
    with pytest.raises(BuildError, match=r"takes libcuda.so from .*/opt/cuda/lib64/stubs first"):
        build_stubs(tmp_path / "out", root=root, env=env(CUDA_HOME="/opt/cuda", CONDA_PREFIX="/opt/conda"))
    assert not (tmp_path / "out").exists()


@needs_header
def test_wsl_layout_generates_from_cuda_h(tmp_path):
    root = tmp_path / "root"
    make_lib(root / "usr/lib/wsl/lib/libcuda.so.1", "libcuda.so.1", cuinit_returns=0)  # the WSL driver
    (root / "usr/local/cuda-12.8/include").mkdir(parents=True)
    shutil.copy(REAL_HEADERS[0], root / "usr/local/cuda-12.8/include/cuda.h")
    (root / "usr/local/cuda").symlink_to(root / "usr/local/cuda-12.8")
    out = tmp_path / "out"
    result = build_stubs(out, root=root, env=env())
    assert result.source.startswith("generated from") and result.symbols > 500
    readelf = subprocess.run(["readelf", "-dV", str(out / "libcuda.so")], capture_output=True, text=True).stdout
    assert "Library soname: [libcuda.so.1]" in readelf
    assert ".gnu.version_d" not in readelf  # no symbol versions
    env_sh = (out / "env.sh").read_text()
    assert f'LIBRARY_PATH="{out}' in env_sh and f'FLASHINFER_EXTRA_LDFLAGS="-L{out}' in env_sh
    assert f'TRITON_LIBCUDA_PATH="{root}/usr/lib/wsl/lib"' in env_sh  # this machine's ldconfig lacks libcuda
    assert not (out / "libcuda.so.1").exists()


@needs_header
def test_a_rerun_into_its_own_folder_replaces_it(tmp_path, monkeypatch, capsys):
    """`make stubs && make stubs`: the generated stub's folder holds only the stub's files (no C source beside it),
    so a second run replaces it and exits 0; a folder an older release left with libcuda_stub.c is replaced too."""
    from hybrid_exl3_fixes.cli import main

    root = tmp_path / "root"
    (root / "opt/cuda/include").mkdir(parents=True)
    shutil.copy(REAL_HEADERS[0], root / "opt/cuda/include/cuda.h")
    monkeypatch.setenv("CUDA_HOME", "/opt/cuda")
    for var in ("CONDA_PREFIX", "CUDA_PATH", "LD_LIBRARY_PATH"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("PATH", SYSTEM_PATH)
    out = tmp_path / "build" / "stubs"
    for _ in range(2):
        assert main(["stubs", "--out", str(out), "--root", str(root)]) == 0, capsys.readouterr().err
        assert sorted(p.name for p in out.iterdir()) == ["env.sh", "libcuda.so", "manifest.json"]
    (out / "libcuda_stub.c").write_text("/* what earlier versions of the builder left here */\n")
    assert main(["stubs", "--out", str(out), "--root", str(root)]) == 0
    assert not (out / "libcuda_stub.c").exists()
    assert sorted(p.name for p in out.parent.iterdir()) == ["stubs"]  # no staging or set-aside folder left


@needs_header
def test_program_linked_against_the_stub_loads_the_driver_by_soname(tmp_path):
    out = tmp_path / "out"
    build_stubs(out, env=env(CUDA_HOME=str(Path(REAL_HEADERS[0]).parent.parent)))
    prog = tmp_path / "prog"
    src = tmp_path / "prog.c"
    src.write_text("extern int cuInit(unsigned int);\nint main(void) { return cuInit(0); }\n")
    # linked as flashinfer links: -L...stubs -lcuda, with FLASHINFER_EXTRA_LDFLAGS=-L<out>
    subprocess.run(["gcc", str(src), "-o", str(prog), f"-L{out}", "-lcuda"], check=True)
    driver = make_lib(tmp_path / "driver" / "libcuda.so.1", "libcuda.so.1", cuinit_returns=0)  # a stand-in driver
    ran = subprocess.run([str(prog)], env={"LD_LIBRARY_PATH": str(driver.parent)})
    assert ran.returncode == 0  # the stand-in answered, not the stub (which returns 34)
    missing = subprocess.run([str(prog)], env={"LD_LIBRARY_PATH": str(out)}, capture_output=True, text=True)
    assert missing.returncode != 0 and "libcuda.so.1" in missing.stderr  # the stub folder never satisfies it


@needs_header
def test_real_header_symbols():
    names = driver_symbols(Path(REAL_HEADERS[0]).read_text(errors="replace"))
    assert len(names) > 500
    for name in ("cuInit", "cuMemAlloc_v2", "cuMemcpy", "cuMemcpy_ptds", "cuLaunchKernel", "cuLaunchKernel_ptsz"):
        assert name in names, name


@needs_header
def test_ld_library_path_shadowing_is_warned(tmp_path):
    out = tmp_path / "out"
    result = build_stubs(
        out, env=env(CUDA_HOME=str(Path(REAL_HEADERS[0]).parent.parent), LD_LIBRARY_PATH=f"/usr/lib:{out}")
    )
    assert any("LD_LIBRARY_PATH holds a libcuda stub folder" in w for w in result.warnings)


def test_no_stub_and_no_header_is_a_clear_error(tmp_path):
    with pytest.raises(BuildError, match="no usable libcuda stub and no cuda.h"):
        build_stubs(tmp_path / "out", root=tmp_path / "empty", env=env())
    assert not (tmp_path / "out").exists()


@needs_header
def test_no_compiler_is_a_clear_error(tmp_path):
    bindir = tmp_path / "bin"
    bindir.mkdir()
    (bindir / "readelf").symlink_to(shutil.which("readelf"))
    root = tmp_path / "root"
    (root / "opt/cuda/include").mkdir(parents=True)
    shutil.copy(REAL_HEADERS[0], root / "opt/cuda/include/cuda.h")
    with pytest.raises(BuildError, match="no C compiler"):
        build_stubs(tmp_path / "out", root=root, env={"PATH": str(bindir), "CUDA_HOME": "/opt/cuda"})
    assert not (tmp_path / "out").exists()


def test_output_that_is_a_file_or_holds_other_files_is_refused(tmp_path):
    root = tmp_path / "root"
    make_lib(root / "opt/conda/lib/stubs/libcuda.so", "libcuda.so.1")
    a_file = tmp_path / "file"
    a_file.write_text("x")
    with pytest.raises(BuildError, match="not a folder"):
        build_stubs(a_file, root=root, env=env(CONDA_PREFIX="/opt/conda"))
    with pytest.raises(BuildError, match="cannot write"):
        build_stubs(a_file / "sub", root=root, env=env(CONDA_PREFIX="/opt/conda"))
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "libcuda.so.1").write_text("driver?")
    with pytest.raises(BuildError, match="must hold only the stub"):
        build_stubs(busy, root=root, env=env(CONDA_PREFIX="/opt/conda"))
    assert [p.name for p in busy.iterdir()] == ["libcuda.so.1"] and a_file.read_text() == "x"


@pytest.mark.skipif(
    os.geteuid() == 0, reason="root writes through permission bits; the read-only case needs a normal user"
)
def test_read_only_target_is_refused(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    with pytest.raises(BuildError, match="cannot write|not writable"):
        build_stubs(ro / "out", root=tmp_path, env=env())
    assert list(ro.iterdir()) == []


def test_cli_exit_codes(tmp_path, monkeypatch, capsys):
    from hybrid_exl3_fixes.cli import main

    root = tmp_path / "root"
    make_lib(root / "opt/conda/lib/stubs/libcuda.so", "libcuda.so.1")
    monkeypatch.setenv("CONDA_PREFIX", "/opt/conda")
    for var in ("CUDA_HOME", "CUDA_PATH", "LD_LIBRARY_PATH"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("PATH", SYSTEM_PATH)
    assert main(["stubs", "--out", str(tmp_path / "ok"), "--root", str(root)]) == 0
    assert "self-check passed" in capsys.readouterr().out
    blocker = tmp_path / "file"
    blocker.write_text("x")
    assert main(["stubs", "--out", str(blocker / "out"), "--root", str(root)]) == 2
    assert "cannot write" in capsys.readouterr().err
