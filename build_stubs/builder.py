"""Find or generate a libcuda stub, write it alone into a folder with env.sh and a manifest."""

from __future__ import annotations

import glob
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from hybrid_exl3_fixes.staging import staged_sibling

CUDA_ERROR_STUB_LIBRARY = 34
SONAME = "libcuda.so.1"
STUB_SUBDIRS = ("lib64/stubs", "lib/stubs", "targets/x86_64-linux/lib/stubs")
DEBIAN_STUBS = "/usr/lib/x86_64-linux-gnu/stubs"
WSL_DRIVER_DIR = "/usr/lib/wsl/lib"
EM_X86_64 = 62


class BuildError(Exception):
    """Bad input or environment: the message says what is wrong and what to do."""


@dataclass
class Candidate:
    path: Path
    origin: str
    ok: bool = False
    reason: str = ""


@dataclass
class StubResult:
    out: Path
    source: str
    soname: str
    symbols: int | None
    warnings: list[str] = field(default_factory=list)
    rejected: list[Candidate] = field(default_factory=list)


# -- where to look ------------------------------------------------------------------------


def _under(root: Path, path: str | os.PathLike) -> Path:
    p = Path(path)
    if str(root) == "/" or not p.is_absolute():
        return p
    try:
        p.relative_to(root)  # already inside the fake root (e.g. a which() result)
        return p
    except ValueError:
        return root / p.relative_to("/")


def cuda_prefixes(env: dict[str, str], root: Path) -> list[tuple[str, Path]]:
    """Toolkit prefixes in search order: CUDA_HOME, CUDA_PATH, nvcc's parent, the resolved
    /usr/local/cuda, CONDA_PREFIX, then /usr/local/cuda-* (newest name first)."""
    found: list[tuple[str, Path]] = []
    for var in ("CUDA_HOME", "CUDA_PATH"):
        if env.get(var):
            found.append((var, _under(root, env[var])))
    nvcc = shutil.which("nvcc", path=env.get("PATH", ""))
    if nvcc:
        found.append(("nvcc", Path(os.path.realpath(nvcc)).parent.parent))
    local = _under(root, "/usr/local/cuda")
    if local.exists():
        found.append(("/usr/local/cuda", Path(os.path.realpath(local))))
    if env.get("CONDA_PREFIX"):
        found.append(("CONDA_PREFIX", _under(root, env["CONDA_PREFIX"])))
    for versioned in sorted(glob.glob(str(_under(root, "/usr/local/cuda-*"))), reverse=True):
        found.append(("/usr/local/cuda-*", Path(versioned)))
    seen, unique = set(), []
    for origin, prefix in found:
        key = os.path.realpath(prefix)
        if key not in seen:
            seen.add(key)
            unique.append((origin, prefix))
    return unique


def elf_problem(path: Path, readelf: str) -> str | None:
    """Why ``path`` is not a usable libcuda stub, or None."""
    try:
        head = path.read_bytes()[:20]
    except OSError as exc:
        return f"unreadable: {exc}"
    if head[:4] != b"\x7fELF":
        return "not an ELF file"
    if head[4] != 2 or int.from_bytes(head[18:20], "little") != EM_X86_64:
        return f"not x86-64 (ELF class {head[4]}, machine {int.from_bytes(head[18:20], 'little')})"
    soname = read_soname(path, readelf)
    if soname != SONAME:
        return f"SONAME is {soname!r}, not {SONAME!r}"
    return None


def read_soname(path: Path, readelf: str) -> str | None:
    proc = subprocess.run([readelf, "-d", str(path)], capture_output=True, text=True)
    match = re.search(r"\(SONAME\)\s+Library soname: \[([^\]]+)\]", proc.stdout)
    return match.group(1) if match else None


def read_needed(path: Path, readelf: str) -> list[str]:
    proc = subprocess.run([readelf, "-d", str(path)], capture_output=True, text=True)
    return re.findall(r"\(NEEDED\)\s+Shared library: \[([^\]]+)\]", proc.stdout)


def find_stub_candidates(prefixes: list[tuple[str, Path]], root: Path, readelf: str) -> list[Candidate]:
    """Every libcuda.so in the stub folders of ``prefixes`` (see cuda_prefixes) and Debian's, in
    search order, each accepted or rejected with a reason."""
    dirs: list[tuple[str, Path]] = []
    for origin, prefix in prefixes:
        dirs += [(origin, prefix / sub) for sub in STUB_SUBDIRS]
    dirs.append(("Debian", _under(root, DEBIAN_STUBS)))
    out, seen = [], set()
    for origin, folder in dirs:
        lib = folder / "libcuda.so"
        if not lib.exists() or os.path.realpath(lib) in seen:
            continue
        seen.add(os.path.realpath(lib))
        problem = elf_problem(lib, readelf)
        out.append(Candidate(lib, origin, problem is None, problem or "accepted"))
    return out


def find_cuda_headers(prefixes: list[tuple[str, Path]], root: Path) -> list[Path]:
    """cuda.h from the toolkits in ``prefixes``, then the nvidia-cuda-runtime wheels and triton (this Python)."""
    headers: list[Path] = []
    for _, prefix in prefixes:
        headers += [prefix / "include" / "cuda.h", prefix / "targets" / "x86_64-linux" / "include" / "cuda.h"]
    if str(root) == "/":
        for base in sys.path:
            headers += [Path(base) / "nvidia" / sub / "include" / "cuda.h" for sub in ("cuda_runtime", "cu13", "cu12")]
            headers.append(Path(base) / "triton" / "backends" / "nvidia" / "include" / "cuda.h")
    seen, unique = set(), []
    for header in headers:
        if header.is_file() and os.path.realpath(header) not in seen:
            seen.add(os.path.realpath(header))
            unique.append(header)
    return unique


# -- generation ---------------------------------------------------------------------------


def driver_symbols(header_text: str) -> list[str]:
    """Driver-API function names of a cuda.h: every declared ``cu*`` function, every ``_vN``
    alias a ``#define`` points to, and the per-thread-stream ``_ptds``/``_ptsz`` variants."""
    names = set(re.findall(r"\bCUresult\s+CUDAAPI\s+(cu\w+)\s*\(", header_text))
    for _, target in re.findall(r"^\s*#\s*define\s+(cu\w+)\s+(cu\w+)\s*$", header_text, re.M):
        names.add(target)
    for suffix in ("PTDS", "PTSZ"):
        for inner in re.findall(rf"__CUDA_API_{suffix}\(\s*(cu\w+)\s*\)", header_text):
            names.add(inner)
            names.add(f"{inner}_{suffix.lower()}")
    return sorted(names)


def _compiler(env: dict[str, str]) -> str | None:
    for name in (env.get("CC"), "cc", "gcc"):
        if name and shutil.which(name, path=env.get("PATH", "")):
            return shutil.which(name, path=env.get("PATH", ""))
    return None


def generate_stub(header: Path, dest: Path, cc: str, work: Path) -> int:
    """Compile a stub exporting every driver symbol of ``header``; each returns 34. Returns the count. The C source
    is written in ``work``, never beside ``dest``: the stub folder holds only what _check_out lets a rerun replace."""
    symbols = driver_symbols(header.read_text(errors="replace"))
    if len(symbols) < 100:
        raise BuildError(f"{header} declares only {len(symbols)} driver functions: not a CUDA driver API header")
    source = work / "libcuda_stub.c"
    lines = [
        f"/* libcuda stub generated from {header} by hybrid-exl3-fixes: link-time only. */",
        f"#define STUB {{ return {CUDA_ERROR_STUB_LIBRARY}; /* CUDA_ERROR_STUB_LIBRARY */ }}",
    ]
    lines += [f"int {name}(void) STUB" for name in symbols]
    source.write_text("\n".join(lines) + "\n")
    proc = subprocess.run(
        [cc, "-shared", "-fPIC", "-O0", f"-Wl,-soname,{SONAME}", "-o", str(dest), str(source)],
        capture_output=True,
        text=True,
    )
    if proc.returncode != 0:
        raise BuildError(f"compiling the stub with {cc} failed:\n{proc.stderr[-2000:]}")
    return len(symbols)


# -- checks -------------------------------------------------------------------------------

PROBE_C = "extern int cuInit(unsigned int);\nint main(void) { return cuInit(0) == 0 ? 0 : 1; }\n"


def link_probe(
    cc: str, stub_dir: Path, work: Path, cuda_home: Path | None, readelf: str, env: dict[str, str]
) -> list[str]:
    """Link a probe as flashinfer links (``-L$CUDA_HOME/lib64 -L$CUDA_HOME/lib64/stubs [-lcudart]
    -lcuda`` + ``FLASHINFER_EXTRA_LDFLAGS=-L<stub dir>``); it must record NEEDED libcuda.so.1.
    Returns warnings (e.g. a compiler that ignores LIBRARY_PATH)."""
    warnings = []
    src = work / "probe.c"
    src.write_text(PROBE_C)
    flags = []
    if cuda_home is not None:
        flags += [f"-L{cuda_home}/lib64", f"-L{cuda_home}/lib64/stubs"]
        if (cuda_home / "lib64" / "libcudart.so").exists():
            flags.append("-lcudart")
    probe = work / "probe"
    cmd = [cc, str(src), "-o", str(probe), *flags, f"-L{stub_dir}", "-lcuda"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**env, "LIBRARY_PATH": ""})
    if proc.returncode != 0:
        raise BuildError(
            f"self-check: linking a probe as flashinfer does failed ({' '.join(cmd)}):\n{proc.stderr[-2000:]}"
        )
    needed = read_needed(probe, readelf)
    if SONAME not in needed:
        ahead = [d for d in flags if d.startswith("-L") and (Path(d[2:]) / "libcuda.so").exists()]
        raise BuildError(
            f"self-check: a probe linked as flashinfer links records NEEDED {needed}, not {SONAME}. "
            + (
                f"The linker takes libcuda.so from {ahead[0][2:]} first (flashinfer's own -L comes before "
                "FLASHINFER_EXTRA_LDFLAGS): fix or remove that file, or point CUDA_HOME at a toolkit without it"
                if ahead
                else "The stub does not link as expected"
            )
        )
    via_library_path = subprocess.run(
        [cc, str(src), "-o", str(work / "probe2"), "-lcuda"],
        capture_output=True,
        text=True,
        env={**env, "LIBRARY_PATH": str(stub_dir)},
    )
    if via_library_path.returncode != 0:
        warnings.append(
            f"{cc} ignores LIBRARY_PATH (conda's cross-built compilers do): builds that do not read "
            "FLASHINFER_EXTRA_LDFLAGS need -L<stub dir> passed by hand"
        )
    return warnings


def ld_library_path_warnings(env: dict[str, str], out: Path) -> list[str]:
    warnings = []
    for entry in filter(None, env.get("LD_LIBRARY_PATH", "").split(":")):
        folder = Path(entry)
        holds_stub = (folder / "libcuda.so").exists() and not (folder / SONAME).exists()
        if os.path.realpath(folder) == os.path.realpath(out) or holds_stub:
            warnings.append(
                f"LD_LIBRARY_PATH holds a libcuda stub folder ({entry}): it shadows the driver at run time "
                f"(cuInit returns {CUDA_ERROR_STUB_LIBRARY}, CUDA_ERROR_STUB_LIBRARY). Remove it from LD_LIBRARY_PATH."
            )
    return warnings


def ldconfig_knows_libcuda() -> bool:
    ldconfig = shutil.which("ldconfig") or ("/sbin/ldconfig" if os.path.exists("/sbin/ldconfig") else None)
    if not ldconfig:
        return False
    proc = subprocess.run([ldconfig, "-p"], capture_output=True, text=True)
    return SONAME in proc.stdout


def env_sh(out: Path, wsl_driver: Path | None) -> str:
    lines = [
        "# Generated by `hybrid-exl3-fixes stubs`. Source it before starting aphrodite (flashinfer JIT links",
        "# against this stub; at run time the program loads the real driver, libcuda.so.1).",
        "# Never add this folder to LD_LIBRARY_PATH: the stub would shadow the driver.",
        f'export LIBRARY_PATH="{out}${{LIBRARY_PATH:+:$LIBRARY_PATH}}"',
        f'export FLASHINFER_EXTRA_LDFLAGS="-L{out}${{FLASHINFER_EXTRA_LDFLAGS:+ $FLASHINFER_EXTRA_LDFLAGS}}"',
    ]
    if wsl_driver is not None:
        lines.append("# WSL2: ldconfig -p does not list libcuda.so.1; triton finds the driver here instead")
        lines.append(f'export TRITON_LIBCUDA_PATH="{wsl_driver}"')
    return "\n".join(lines) + "\n"


# -- the whole job ------------------------------------------------------------------------


# What a stub folder holds, and so what a rerun into it may replace; libcuda_stub.c is the C source that earlier
# versions of this builder left beside a generated stub.
STUB_FILES = ("libcuda.so", "manifest.json", "env.sh", "libcuda_stub.c")


def _check_out(out: Path) -> None:
    if out.exists() and not out.is_dir():
        raise BuildError(f"{out} exists and is not a folder")
    if out.is_dir():
        foreign = sorted(p.name for p in out.iterdir() if p.name not in STUB_FILES)
        if foreign:
            raise BuildError(
                f"{out} holds other files ({', '.join(foreign)}); the stub folder must hold only the stub. "
                "Choose an empty or new folder"
            )
        if not os.access(out, os.W_OK):
            raise BuildError(f"{out} is not writable; choose another --out")
        return
    parent = out.parent
    while not parent.exists():
        parent = parent.parent
    if not os.access(parent, os.W_OK):
        raise BuildError(f"cannot write under {parent} (read-only or not yours); choose another --out")


def build_stubs(out: str | os.PathLike, root: str | os.PathLike = "/", env: dict[str, str] | None = None) -> StubResult:
    env = dict(os.environ if env is None else env)
    out = Path(out).absolute()
    root = Path(root).absolute()
    readelf = shutil.which("readelf", path=env.get("PATH", "")) or shutil.which("readelf")
    if not readelf:
        raise BuildError("readelf (binutils) is needed to check ELF files: apt-get install binutils")
    _check_out(out)

    prefixes = cuda_prefixes(env, root)
    candidates = find_stub_candidates(prefixes, root, readelf)
    chosen = next((c for c in candidates if c.ok), None)
    rejected = [c for c in candidates if not c.ok]
    cc = _compiler(env)
    cuda_home = prefixes[0][1] if prefixes else None

    # Everything is built in a temporary sibling folder renamed into place at the end: a failure, SIGTERM or SIGHUP
    # leaves nothing behind (parent folders this call created are removed too).
    created = _missing_parents(out)

    def cannot_create(exc: OSError) -> Exception:
        return BuildError(f"cannot write the stub folder {out}: {exc.strerror or exc}; choose another --out")

    ok = False
    try:
        with staged_sibling(out, f".{out.name}.staging-", cannot_create) as staging:
            stage_lib = staging / "lib" / "libcuda.so"
            stage_lib.parent.mkdir()
            if chosen is not None:
                shutil.copyfile(chosen.path, stage_lib)
                source, symbols = f"copied from {chosen.path} ({chosen.origin})", None
            else:
                headers = find_cuda_headers(prefixes, root)
                if not headers:
                    detail = "".join(f"\n  rejected {c.path}: {c.reason}" for c in rejected)
                    raise BuildError(
                        "no usable libcuda stub and no cuda.h to generate one from. Install a CUDA toolkit, or "
                        "`pip install nvidia-cuda-runtime-cu12` (it ships include/cuda.h), or set CUDA_HOME." + detail
                    )
                if cc is None:
                    raise BuildError(
                        "no C compiler (cc/gcc, or $CC) to build the stub from "
                        f"{headers[0]}: apt-get install gcc, or set CC"
                    )
                (staging / "src").mkdir()
                symbols = generate_stub(headers[0], stage_lib, cc, staging / "src")
                source = f"generated from {headers[0]}"
            soname = read_soname(stage_lib, readelf)
            if soname != SONAME:
                raise BuildError(f"self-check: the stub's SONAME is {soname!r}, not {SONAME!r}")
            warnings = []
            if cc is not None:
                work = staging / "probe"
                work.mkdir()
                warnings += link_probe(cc, stage_lib.parent, work, cuda_home, readelf, env)
            else:
                warnings.append("no C compiler: the link self-check was skipped")
            warnings += ld_library_path_warnings(env, out)
            wsl_dir = _under(root, WSL_DRIVER_DIR)
            wsl_driver = wsl_dir if (wsl_dir / SONAME).exists() and not ldconfig_knows_libcuda() else None
            manifest = {
                "source": source,
                "soname": soname,
                "symbols": symbols,
                "out": str(out),
                "sha256": hashlib.sha256(stage_lib.read_bytes()).hexdigest(),
                "rejected": [{"path": str(c.path), "reason": c.reason} for c in rejected],
                "warnings": warnings,
                "error_code_returned": CUDA_ERROR_STUB_LIBRARY,
            }
            (staging / "lib" / "manifest.json").write_text(json.dumps(manifest, indent=2))
            (staging / "lib" / "env.sh").write_text(env_sh(out, wsl_driver))
            _move_into_place(staging / "lib", out)
            ok = True
            return StubResult(out, source, soname, symbols, warnings, rejected)
    except OSError as exc:  # a full disk, a folder that vanished: nothing is left behind
        raise BuildError(f"writing the stub folder {out} failed: {exc.strerror or exc}") from exc
    finally:
        if not ok:
            _remove_created(created)


def _missing_parents(out: Path) -> list[Path]:
    """The folders above ``out`` that do not exist yet (outermost last), to remove after a failure."""
    missing, parent = [], out.parent
    while not parent.exists() and parent != parent.parent:
        missing.append(parent)
        parent = parent.parent
    return missing


def _remove_created(created: list[Path]) -> None:
    for folder in created:  # innermost first
        try:
            folder.rmdir()
        except OSError:
            break


def _move_into_place(built: Path, out: Path) -> None:
    """Rename the built folder to ``out``; an older stub folder there (only stub files, _check_out made
    sure) is set aside first and removed after the rename."""
    old = None
    if out.is_dir():
        old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
        os.replace(out, old / "stubs")
    try:
        os.replace(built, out)
    except OSError:
        if old is not None:
            os.replace(old / "stubs", out)
        raise
    finally:
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
