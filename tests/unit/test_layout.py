"""The repository's layout holds what docs/development.md says of it (CPU, no aphrodite needed): one module per
patch exporting ``PATCH``, no patch module importing another, the diffs numbered by patch id and named by the
patch's write-up, every test file named after what it tests, each package's opening docstring present, and no file
of the project pointing to a file outside the repository."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from helpers import ROOT

OVERLAY = ROOT / "overlay"
PATCH_MODULES = sorted(p for p in (OVERLAY / "aphrodite").rglob("*.py") if p.name != "__init__.py")


def patch_records() -> dict[str, dict]:
    """{patch id: {"module": path, "slug": ...}} read from each patch module's ``PATCH = Patch(...)`` (by ast, so
    that no aphrodite is needed)."""
    out = {}
    for path in PATCH_MODULES:
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.Assign) and [t.id for t in node.targets if isinstance(t, ast.Name)] == ["PATCH"]:
                fields = {k.arg: k.value.value for k in node.value.keywords if isinstance(k.value, ast.Constant)}
                out[fields["id"]] = {"module": path, **fields}
    return out


def test_every_patch_module_exports_one_patch_named_patch():
    records = patch_records()
    assert {r["module"] for r in records.values()} == set(PATCH_MODULES)
    for path in PATCH_MODULES:
        names = {
            t.id
            for n in ast.parse(path.read_text()).body
            if isinstance(n, ast.Assign)
            for t in n.targets
            if isinstance(t, ast.Name) and t.id.startswith("PATCH")
        }
        assert names == {"PATCH"}, (path, names)


def test_no_patch_module_imports_another():
    stems = {
        "hybrid_exl3_fixes." + p.relative_to(OVERLAY).with_suffix("").as_posix().replace("/", ".")
        for p in PATCH_MODULES
    }
    for path in PATCH_MODULES:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                module = node.module or ""
                assert not node.level, f"{path.name} imports .{module}: a sibling patch module"
                imported = {module, *(f"{module}.{a.name}" for a in node.names)}
                assert not imported & stems, f"{path.name} imports the patch module(s) {imported & stems}"


def test_each_diff_is_numbered_by_its_patch_id_and_named_by_its_write_up():
    """``patches/NNNN-SLUG.patch``: NNNN the patch id (P2b: 0002b), SLUG the patch's slug, which is its write-up's
    name in docs/upstream/ wherever it has one."""
    records = patch_records()
    by_number = {r["id"].lstrip("P").rjust(4 + r["id"].endswith("b"), "0"): r for r in records.values()}
    for diff in sorted((ROOT / "patches").glob("*.patch")):
        number, _, slug = diff.stem.partition("-")
        assert number in by_number, f"{diff.name}: no patch {number}"
        assert slug == by_number[number]["slug"], (diff.name, by_number[number]["slug"])
    for record in records.values():
        cited = set(re.findall(r"docs/upstream/([a-z0-9-]+)\.md", record["module"].read_text()))
        writeup = ROOT / "docs" / "upstream" / f"{record['slug']}.md"
        if writeup.exists():
            assert record["slug"] in cited, (record["id"], "its write-up is not cited in its module")


def test_each_test_file_is_named_after_what_it_tests():
    """tests/unit/test_pN_STEM.py tests patch N's module STEM; tests/bench/test_STEM.py a module of bench/ (or
    its driver); tests/ci/test_STEM.py a script of ci/."""
    records = patch_records()
    tested = set()
    for test in sorted((ROOT / "tests" / "unit").glob("test_p[0-9]*.py")):
        name = test.stem.removeprefix("test_")
        patch_id = "P" + re.match(r"p(\d+b?)_", name).group(1)
        module = records[patch_id]["module"].stem.lstrip("_")
        assert name == module or (name.startswith(patch_id.lower() + "_") and name.endswith(module)), test.name
        tested.add(patch_id)
    assert tested == set(records), set(records) - tested  # every patch has its test file
    bench = {p.stem for p in (ROOT / "bench").glob("*.py")}
    for test in sorted((ROOT / "tests" / "bench").glob("test_*.py")):
        assert test.stem.removeprefix("test_") in bench, test.name
    ci = {p.stem.replace("-", "_") for p in (ROOT / "ci").glob("*")}
    for test in sorted((ROOT / "tests" / "ci").glob("test_*.py")):
        assert test.stem.removeprefix("test_") in ci, test.name


@pytest.mark.parametrize("package", sorted({p.parent for p in OVERLAY.rglob("*.py")}), ids=lambda p: p.name)
def test_each_package_says_what_it_holds(package):
    init = package / "__init__.py"
    assert init.exists(), package
    assert (
        ast.get_docstring(ast.parse(init.read_text()))
        or package.parent.name == "aphrodite"
        or not [p for p in package.glob("*.py") if p.name != "__init__.py"]
    ), f"{package.relative_to(ROOT)} has no docstring"


def project_files() -> list[Path]:
    tracked = ["overlay", "bench", "ci", "build_stubs", "tests", "docs", "patches"]
    files = [ROOT / "pyproject.toml", ROOT / "Makefile", ROOT / "README.md"]
    for folder in tracked:
        files += [
            p
            for p in (ROOT / folder).rglob("*")
            if p.is_file() and p.suffix in (".py", ".sh", ".md", ".toml", ".patch") and "gpu-runs" not in p.parts
        ]
    return files


def test_nothing_points_to_a_file_outside_the_repository():
    """The facts the project stands on are stated where they are used, with their real source (a wheel's file, an
    upstream PR, a run record): never a pointer to a notes file that is not part of the repository."""
    outside = re.compile(r"\b(FACTS|STYLE)\.md\b|\.\./shared/")
    found = [f"{p.relative_to(ROOT)}:{n}" for p in project_files() for n, line in
             enumerate(p.read_text(errors="replace").splitlines(), 1) if outside.search(line)
             and p != Path(__file__)]  # fmt: skip
    assert not found, found


def test_every_relative_link_of_the_docs_resolves():
    """README.md, docs/ (the run records included), bench/README.md and bench/results/: every relative markdown link
    names a file or folder of the repository."""
    pages = [ROOT / "README.md", ROOT / "bench" / "README.md", *(ROOT / "docs").rglob("*.md")]
    pages += list((ROOT / "bench" / "results").glob("*.md"))
    broken = []
    for page in pages:
        for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text(errors="replace")):
            if re.match(r"^(https?:|mailto:|#)", target):
                continue
            if not (page.parent / target.split("#")[0]).exists():
                broken.append(f"{page.relative_to(ROOT)}: {target}")
    assert not broken, broken
