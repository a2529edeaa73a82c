"""doctor on hundreds of broken model folders: no traceback, a non-zero exit, a message
that names the problem.

Every case is a copy of a good make-tiny folder (files linked, the broken one written) with one
thing broken: a safetensors file truncated at every structural boundary or with a flipped header
byte, each config field doctor reads removed or given each wrong JSON type, quantization_config.json
and the shard index broken, files replaced by folders, dangling links and link loops, and a
MODEL_DIR that is a file. doctor runs through the CLI (``main([... "--json"])``) in this process:
an escaping exception fails the case, and so does the CLI's internal-error exit (70).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import struct
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hybrid_exl3_fixes.checkpoint.tiny import TinySpec, write_tiny
from hybrid_exl3_fixes.cli import EXIT_INTERNAL, main

WRONG_VALUES = {
    "a string": "x",
    "a float": 1.5,
    "a boolean": True,
    "a list": [1],
    "an object": {"a": 1},
    "null": None,
    "zero": 0,
    "negative": -4,
}
# (path inside config.json, required: removing it is a problem too)
CONFIG_FIELDS = [
    (("architectures",), True),
    (("text_config",), True),
    (("quantization_config",), False),
    (("quantization_config", "quant_method"), True),
    (("quantization_config", "head_bits"), False),
    (("vision_config",), False),
    (("vision_config", "patch_size"), False),
    (("vision_config", "spatial_merge_size"), False),
    (("text_config", "dtype"), False),
    (("text_config", "mamba_ssm_dtype"), False),
    (("text_config", "hidden_size"), True),
    (("text_config", "num_attention_heads"), True),
    (("text_config", "num_hidden_layers"), True),
    (("text_config", "layer_types"), False),
    (("text_config", "num_key_value_heads"), True),
    (("text_config", "head_dim"), False),
    (("text_config", "linear_num_value_heads"), True),
    (("text_config", "linear_num_key_heads"), True),
    (("text_config", "linear_key_head_dim"), True),
    (("text_config", "linear_value_head_dim"), True),
    (("text_config", "linear_conv_kernel_dim"), False),
    (("text_config", "max_position_embeddings"), False),
]
# values of the wrong type that are still right for a field: null removes an optional field; a list of
# strings is what architectures / layer_types want (the list [1] is not)
ACCEPTABLE = {
    ("quantization_config", "head_bits"): {"zero", "null", "a float"},
    ("vision_config",): {"an object"},
}  # {"a": 1}: the vision fields doctor reads have defaults


@pytest.fixture(scope="module")
def good(tmp_path_factory) -> Path:
    dest = tmp_path_factory.mktemp("corpus") / "tiny"
    write_tiny(dest, TinySpec(), dense=False)
    return dest / "exl3"


def doctor(folder: Path, *flags: str) -> tuple[int, dict, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(["doctor", str(folder), "--language-model-only", "--json", *flags])
    assert code != EXIT_INTERNAL, err.getvalue()
    return code, json.loads(out.getvalue()), err.getvalue()


def messages(report: dict, levels=("BLOCK", "WARN")) -> str:
    return "\n".join(f"{f['check']}: {f['message']}" for f in report["findings"] if f["level"] in levels)


def broken_copy(good: Path, dest: Path, **files) -> Path:
    """A folder of links to ``good``'s files, except ``files``: bytes (written), None (left out), "dir" (a
    folder of that name), "dangling" (a link to nothing), "loop" (a link to itself)."""
    dest.mkdir(parents=True)
    names = {p.name for p in good.iterdir()} | {k.replace("__", ".") for k in files}
    for name in names:
        change = files.get(name.replace(".", "__"), ...)
        target = dest / name
        if change is ...:
            target.symlink_to(good / name)
        elif change is None:
            continue
        elif change == "dir":
            target.mkdir()
        elif change == "dangling":
            target.symlink_to(dest / "no-such-file")
        elif change == "loop":
            target.symlink_to(target)
        else:
            target.write_bytes(change)
    return dest


def expect_problem(good: Path, dest: Path, needle: str, **files) -> dict:
    code, report, _ = doctor(broken_copy(good, dest, **files))
    assert code in (1, 2), messages(report)
    assert needle in messages(report), (needle, messages(report))
    return report


def test_the_good_folder_is_clean(good):
    code, report, _ = doctor(good)
    assert code == 0, messages(report)


# -- safetensors ------------------------------------------------------------------------------


def boundaries(path: Path) -> list[int]:
    """Every structural boundary of a safetensors file: inside the length field, inside and at the
    end of the header, each of the first tensors' data start, start + 1 and end - 1, the last byte."""
    raw = path.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + length])
    spans = sorted(tuple(v["data_offsets"]) for k, v in header.items() if k != "__metadata__")
    cuts = {0, 1, 4, 7, 8, 9, 8 + length // 2, 8 + length - 1, 8 + length, len(raw) - 1}
    for start, end in spans[:6] + spans[-3:]:
        cuts |= {8 + length + start + 1, 8 + length + end - 1}
    return sorted(c for c in cuts if 0 <= c < len(raw))


def test_truncated_safetensors_at_every_boundary(good, tmp_path):
    raw = (good / "model.safetensors").read_bytes()
    cuts = boundaries(good / "model.safetensors")
    assert len(cuts) >= 25
    for i, cut in enumerate(cuts):
        report = expect_problem(good, tmp_path / f"cut{i}", "model.safetensors", model__safetensors=raw[:cut])
        assert any(f["check"] == "weights" and f["level"] == "BLOCK" for f in report["findings"]), cut


def test_a_header_length_larger_than_the_file_reads_nothing_more(good, tmp_path):
    raw = (good / "model.safetensors").read_bytes()
    huge = struct.pack("<Q", 10**12) + raw[8:]
    expect_problem(good, tmp_path / "huge", "header claims 1,000,000,000,000 bytes", model__safetensors=huge)


# derandomize: CI draws the same 120 examples every run (a new failure is found by raising max_examples
# locally, not by chance in CI); the case it first found (the I32 mcg marker flipped to F32) has its own test
@settings(
    max_examples=120, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=st.data())
def test_flipped_header_bytes(good, tmp_path_factory, data):
    raw = bytearray((good / "model.safetensors").read_bytes())
    (length,) = struct.unpack("<Q", raw[:8])
    pos = data.draw(st.integers(8, 8 + length - 1), label="position")
    byte = data.draw(st.integers(0, 255).filter(lambda b: b != raw[pos]), label="byte")
    original = json.loads(raw[8 : 8 + length])
    raw[pos] = byte
    folder = broken_copy(good, tmp_path_factory.mktemp("flip") / "m", model__safetensors=bytes(raw))
    code, report, _ = doctor(folder)
    try:
        flipped = json.loads(bytes(raw[8 : 8 + length]).decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        flipped = None
    storage = json.loads((good / "quantization_config.json").read_text())["tensor_storage"]
    listed = {n for e in storage.values() for n in e.get("stored_tensors", {})}
    if isinstance(flipped, dict):
        changed = {k for k in set(original) | set(flipped) if k != "__metadata__" and original.get(k) != flipped.get(k)}
        if not changed:
            return  # whitespace, the metadata: the same tensors, nothing to find

        def entries(header):
            return sorted(json.dumps(v, sort_keys=True) for k, v in header.items() if k != "__metadata__")

        if entries(flipped) == entries(original) and not changed & listed:
            return  # a tensor tensor_storage does not list was renamed: nothing says what its name should be
    assert code in (1, 2), (pos, byte, messages(report))
    assert "model.safetensors" in messages(report) or "tensor_storage" in messages(report), messages(report)


def test_a_tensor_whose_dtype_changed_in_the_header(good, tmp_path):
    """Found by the flip test: "I32" -> "F32" in an mcg marker's header entry keeps its size, so only the
    dtype tensor_storage lists can tell."""
    raw = (good / "model.safetensors").read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    header = raw[8 : 8 + length]
    at = header.index(b'.mcg":{"dtype":"I32"') + len('.mcg":{"dtype":"')
    flipped = raw[: 8 + at] + b"F" + raw[8 + at + 1 :]
    expect_problem(good, tmp_path / "d", "torch.int32 != F32", model__safetensors=flipped)


def test_sharded_index_naming_missing_shards(good, tmp_path):
    index = {
        "metadata": {},
        "weight_map": {
            "model.language_model.norm.weight": "model-00001-of-00002.safetensors",
            "lm_head.weight": "model-00002-of-00002.safetensors",
        },
    }
    expect_problem(
        good,
        tmp_path / "idx",
        "names 2 shard(s) that are not in the folder",
        model__safetensors__index__json=json.dumps(index).encode(),
    )
    expect_problem(
        good, tmp_path / "idx2", "model.safetensors.index.json is not valid JSON", model__safetensors__index__json=b"{"
    )
    expect_problem(
        good,
        tmp_path / "idx3",
        "weight_map is missing",
        model__safetensors__index__json=json.dumps({"weight_map": 3}).encode(),
    )


# -- config.json ------------------------------------------------------------------------------


def edited_config(good: Path, path: tuple[str, ...], value=...) -> bytes:
    config = json.loads((good / "config.json").read_text())
    node = config
    for key in path[:-1]:
        node = node[key]
    if value is ...:
        del node[path[-1]]
    else:
        node[path[-1]] = value
    return json.dumps(config).encode()


CASES = [
    (path, label, value)
    for path, _ in CONFIG_FIELDS
    for label, value in WRONG_VALUES.items()
    if label not in ACCEPTABLE.get(path, set())
    and not (label == "null" and path[-1] in ("quantization_config", "vision_config", "dtype", "mamba_ssm_dtype"))
]


@pytest.mark.parametrize("path, label, value", CASES, ids=[f"{'.'.join(p)}={label}" for p, label, _ in CASES])
def test_every_config_field_with_every_wrong_type(good, tmp_path, path, label, value):
    required = dict(CONFIG_FIELDS)[path]
    if label == "null" and not required:
        return  # null is how JSON leaves an optional field out
    folder = broken_copy(good, tmp_path / "c", config__json=edited_config(good, path, value))
    code, report, _ = doctor(folder)
    assert code in (1, 2), messages(report)
    # the field is named; a wrong text_config/quantization_config object is named as such
    assert path[-1] in messages(report), messages(report)


@pytest.mark.parametrize("path", [p for p, _ in CONFIG_FIELDS], ids=[".".join(p) for p, _ in CONFIG_FIELDS])
def test_every_config_field_removed(good, tmp_path, path):
    folder = broken_copy(good, tmp_path / "r", config__json=edited_config(good, path))
    code, report, _ = doctor(folder)
    if dict(CONFIG_FIELDS)[path]:
        assert code in (1, 2) and path[-1] in messages(report) or path == ("text_config",), messages(report)
        if path == ("text_config",):  # the fields are then looked for at the top level, and missing there
            assert code == 2 and "hidden_size is missing" in messages(report)


@pytest.mark.parametrize(
    "content, needle",
    [
        (b"", "config.json is not valid JSON"),
        (b"{not json", "config.json is not valid JSON"),
        (b"[1, 2]", "config.json holds a list, not a JSON object"),
        (b'"x"', "holds a string"),
        (b"\xff\xfe{}", "not UTF-8"),
        (b"[" * 100000 + b"]" * 100000, "config.json"),
    ],
)
def test_config_that_is_not_a_json_object(good, tmp_path, content, needle):
    expect_problem(good, tmp_path / "j", needle, config__json=content)


# -- quantization_config.json, processor, files -------------------------------------------------


@pytest.mark.parametrize(
    "content, needle",
    [
        (b"{", "quantization_config.json is not valid JSON"),
        (b"[]", "holds a list"),
        (b'{"tensor_storage": 3}', "tensor_storage is 3"),
        (b'{"bits": 4}', "tensor_storage is missing"),
        (b'{"tensor_storage": {"model.x": 5}}', "malformed tensor_storage"),
        (b'{"tensor_storage": {"model.x": {"stored_tensors": {"a": {"shape": "big"}}}}}', "malformed tensor_storage"),
        (
            b'{"tensor_storage": {"model.x": {"stored_tensors": [], "quant_format": "exl3"}}}',
            "malformed tensor_storage",
        ),
        (b'{"tensor_storage": {"model.x": {"quant_format": 7}}}', "quant_format is 7"),
    ],
)
def test_broken_quantization_config_json(good, tmp_path, content, needle):
    expect_problem(good, tmp_path / "q", needle, quantization_config__json=content)


@pytest.mark.parametrize(
    "content, needle",
    [(b"{", "preprocessor_config.json is not valid JSON"), (b'{"size": {"longest_edge": "huge"}}', "longest_edge is")],
)
def test_broken_preprocessor_config(good, tmp_path, content, needle):
    expect_problem(good, tmp_path / "p", needle, preprocessor_config__json=content)


@pytest.mark.parametrize(
    "name",
    ["config.json", "model.safetensors", "quantization_config.json", "tokenizer.json", "preprocessor_config.json"],
)
@pytest.mark.parametrize("kind", ["dir", "dangling", "loop", None])
def test_files_that_are_folders_links_to_nothing_or_missing(good, tmp_path, name, kind):
    if kind is None and name == "preprocessor_config.json":
        return  # text only: not needed
    code, report, _ = doctor(broken_copy(good, tmp_path / "f", **{name.replace(".", "__"): kind}))
    assert code in (1, 2), messages(report)
    named = name if name != "tokenizer.json" else "no tokenizer"
    if kind is None and name == "model.safetensors":
        named = "model.language_model"  # the EXL3 tensors tensor_storage names are missing
    assert named in messages(report), messages(report)


def test_model_dir_that_is_a_file_a_loop_or_missing(good, tmp_path):
    (tmp_path / "file").write_text("x")
    (tmp_path / "loop").symlink_to(tmp_path / "loop")
    for target, needle in (
        (tmp_path / "file", "is a file, not a folder"),
        (tmp_path / "loop", "does not exist"),
        (tmp_path / "missing", "does not exist"),
        (good / "config.json", "is a file"),
    ):
        code, report, _ = doctor(target)
        assert code == 2 and needle in messages(report), messages(report)


def test_kv_cache_dtype_is_taken_under_the_engines_own_name(good):
    """`--kv-cache-dtype fp8_e4m3`, as a user copies it from the aphrodite command line, plans the same
    1-byte KV cache as `--kv-dtype fp8`; bfloat16 the same as auto for a bfloat16 model."""

    def plan(*flags):
        code, report, _ = doctor(good, "--gpu-mem", "24", "--max-model-len", "4096", *flags)
        assert code != 2, messages(report)
        return report["plan"]

    def figures(p):  # the plan without its echo of the arguments
        return {k: v for k, v in p.items() if k != "engine"}

    e4m3 = plan("--kv-cache-dtype", "fp8_e4m3")
    assert e4m3["engine"]["kv_dtype"] == "fp8_e4m3"
    assert figures(e4m3) == figures(plan("--kv-dtype", "fp8")) != figures(plan())
    assert figures(plan("--kv-cache-dtype", "bfloat16")) == figures(plan())


def test_bad_flags_are_usage_errors_not_tracebacks(good, capsys):
    for flags in (
        ["--tp", "0"],
        ["--gpu-mem", "-1"],
        ["--gpu-mem", "nan"],
        ["--gpu-memory-utilization", "2"],
        ["--max-model-len", "x"],
        ["--kv-dtype", "int4"],
        ["--kv-cache-dtype", "fp4"],
        ["--dtype", "int8"],
        ["--max-num-batched-tokens", "0"],
        ["--max-loras", "-2"],
        ["--max-lora-rank", "big"],
        ["--limit-mm-per-prompt", '{"image": -1}'],
    ):
        with pytest.raises(SystemExit) as exit_:
            main(["doctor", str(good), *flags])
        assert exit_.value.code == 2
        assert "error: argument" in capsys.readouterr().err


def test_every_problem_in_one_run(good, tmp_path):
    config = json.loads((good / "config.json").read_text())
    config["text_config"].pop("num_key_value_heads")
    config["text_config"]["linear_key_head_dim"] = "wide"
    raw = (good / "model.safetensors").read_bytes()
    folder = broken_copy(
        good,
        tmp_path / "all",
        config__json=json.dumps(config).encode(),
        model__safetensors=raw[: len(raw) // 2],
        quantization_config__json=b"{",
        tokenizer__json=None,
    )
    code, report, _ = doctor(folder)
    text = messages(report)
    assert code == 2
    for needle in (
        "num_key_value_heads is missing",
        'linear_key_head_dim is "wide"',
        "model.safetensors",
        "quantization_config.json is not valid JSON",
        "no tokenizer",
    ):
        assert needle in text, (needle, text)


def test_subprocess_cli_never_prints_a_traceback(good, tmp_path):
    """The console script itself on a few of the worst inputs."""
    import subprocess
    import sys

    (tmp_path / "junk.safetensors").write_bytes(b"\xff" * 7)
    for args in (
        ["doctor", str(tmp_path)],
        ["doctor", str(tmp_path / "junk.safetensors")],
        ["make-tiny", str(good / "config.json" / "x")],
        ["stubs", "--out", str(good / "config.json")],
        ["doctor", str(good), "--tp", "-3"],
    ):
        proc = subprocess.run(
            [sys.executable, "-m", "hybrid_exl3_fixes.cli", *args],
            capture_output=True,
            text=True,
            timeout=300,
            env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"},
        )
        assert proc.returncode != 0 and "Traceback" not in proc.stdout + proc.stderr, (args, proc.stderr)
