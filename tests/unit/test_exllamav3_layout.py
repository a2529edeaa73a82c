"""The tiny checkpoint's EXL3 layout against exllamav3's own code.

exllamav3 is the format's owner. Its package is not imported (that JIT-compiles its CUDA
extension); its sources (ci/exllamav3-source.sh) are read with ``ast`` at test time, so the
expectations below come from exllamav3's code, not from a copy of it:

- which Qwen3.5 projections are quantized: exllamav3's Linear is quantized unless built with
  ``qmap = None``; qwen3_5.py passes a qmap to Attention and GatedMLP, and GatedDeltaNet builds
  some of its projections with ``qmap = None``;
- the tensor-name prefix of the language model (``key_prefix`` in qwen3_5.py);
- the MTP head (qwen3_5_mtp.py): quantized at ``mtp_bits`` (its ``qbits_key``), its fc and its
  attention and MLP projections, under the top-level ``mtp.`` prefix;
- the tensors an EXL3 linear is loaded from (modules/linear.py);
- the fields of a tensor_storage entry (conversion/quant_config.py) and its dtype strings.
"""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest
import torch

from hybrid_exl3_fixes.checkpoint.tiny import TinySpec, write_tiny

ROOT = Path(__file__).resolve().parents[2]
SOURCES = sorted((ROOT / ".cache" / "exllamav3").glob("*/exllamav3"))
pytestmark = pytest.mark.skipif(not SOURCES, reason="exllamav3 sources not fetched (bash ci/exllamav3-source.sh)")
EXL = SOURCES[-1] if SOURCES else None


def parse(rel: str) -> ast.Module:
    return ast.parse((EXL / rel).read_text())


def first_call(tree: ast.AST, name: str, key_suffix: str | None = None) -> ast.Call:
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == name:
            key = ast.unparse(next(k.value for k in node.keywords if k.arg == "key")).rstrip("'\"")
            if key_suffix is None or key.endswith(key_suffix):
                return node
    raise AssertionError(f"no {name}(...) call in exllamav3")


def string_kwargs(call: ast.Call) -> dict[str, str]:
    return {
        k.arg: k.value.value
        for k in call.keywords
        if isinstance(k.value, ast.Constant) and isinstance(k.value.value, str)
    }


def gdn_unquantized_key_params() -> set[str]:
    """Parameter names (key_b, key_a, ...) of the GatedDeltaNet projections built with qmap = None."""
    found = set()
    for node in ast.walk(parse("modules/gated_delta_net.py")):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "Linear":
            qmap = next((k.value for k in node.keywords if k.arg == "qmap"), None)
            if isinstance(qmap, ast.Constant) and qmap.value is None and len(node.args) > 1:
                found |= {n.id for n in ast.walk(node.args[1]) if isinstance(n, ast.Name) and n.id.startswith("key_")}
    return found


def expected_exl3_suffixes() -> set[str]:
    model = parse("architecture/qwen3_5.py")
    gdn = string_kwargs(first_call(model, "GatedDeltaNet"))
    attn_call = first_call(model, "Attention")
    mlp_call = first_call(model, "GatedMLP", key_suffix=".mlp")  # not the MoE shared expert
    unquantized = gdn_unquantized_key_params()
    projections = {"key_qkv", "key_z", "key_b", "key_a", "key_o"}
    expected = {f"linear_attn.{v}" for k, v in gdn.items() if k in projections and k not in unquantized}
    for section, call, keys in (
        ("self_attn", attn_call, ("key_q", "key_k", "key_v", "key_o")),
        ("mlp", mlp_call, ("key_gate", "key_up", "key_down")),
    ):
        kwargs = string_kwargs(call)
        assert kwargs.get("qmap"), f"qwen3_5.py builds {section} without a qmap: nothing there would be quantized"
        expected |= {f"{section}.{kwargs[k]}" for k in keys}
    return expected


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    dest = tmp_path_factory.mktemp("x") / "tiny"
    write_tiny(dest, TinySpec(bits=4, codebook="mixed"))
    return dest


def test_quantized_projections_match_exllamav3(tiny):
    storage = json.loads((tiny / "exl3" / "quantization_config.json").read_text())["tensor_storage"]
    ours = {
        k.split(".", 4)[-1] for k, v in storage.items() if v.get("quant_format") == "exl3" and not k.startswith("mtp.")
    }
    expected = expected_exl3_suffixes()
    assert {"linear_attn.in_proj_qkv", "linear_attn.in_proj_z", "linear_attn.out_proj"} <= expected  # sanity
    assert ours == expected
    # and the GDN projections exllamav3 keeps in fp16 are plain weights here
    gdn = string_kwargs(first_call(parse("architecture/qwen3_5.py"), "GatedDeltaNet"))
    for param in gdn_unquantized_key_params() & set(gdn):
        assert f"model.language_model.layers.0.linear_attn.{gdn[param]}" in storage
        assert "quant_format" not in storage[f"model.language_model.layers.0.linear_attn.{gdn[param]}"]


def test_language_model_prefix_matches_exllamav3(tiny):
    prefixes = {}
    for node in ast.walk(parse("architecture/qwen3_5.py")):
        if isinstance(node, ast.ClassDef):
            for kw in ast.walk(node):
                if isinstance(kw, ast.keyword) and kw.arg == "key_prefix" and isinstance(kw.value, ast.Constant):
                    prefixes[node.name] = kw.value.value
    assert prefixes["Qwen3_5VLModel"]  # the ForConditionalGeneration (VL) model
    storage = json.loads((tiny / "exl3" / "quantization_config.json").read_text())["tensor_storage"]
    layer_keys = [k for k in storage if ".layers." in k and not k.startswith("mtp.")]
    assert layer_keys and all(k.startswith(prefixes["Qwen3_5VLModel"] + ".layers.") for k in layer_keys)


def expected_mtp_exl3_keys(layers: int) -> set[str]:
    """The MTP head's quantized modules by qwen3_5_mtp.py: every module built with qbits_key="mtp_bits" that
    holds a projection (the input layer's fc, the blocks' Attention and dense GatedMLP)."""
    tree = parse("architecture/qwen3_5_mtp.py")
    calls = [
        node
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and any(k.arg == "qbits_key" and getattr(k.value, "value", None) == "mtp_bits" for k in node.keywords)
    ]
    names = {c.func.id for c in calls if isinstance(c.func, ast.Name)}
    assert {"Qwen3_5MTPInputLayer", "Attention", "GatedMLP"} <= names, names
    found = set()
    for idx in range(layers):
        for call in calls:
            kwargs = string_kwargs(call)
            if call.func.id == "Qwen3_5MTPInputLayer":
                found.add(kwargs["key_fc"])
                continue
            key = ast.unparse(next(k.value for k in call.keywords if k.arg == "key"))
            key = key.replace("f'", "").replace("'", "").replace("{idx}", str(idx))
            if call.func.id == "Attention":
                found |= {f"{key}.{kwargs[k]}" for k in ("key_q", "key_k", "key_v", "key_o")}
            elif call.func.id == "GatedMLP" and key.endswith(".mlp"):  # the dense block, not the shared expert
                found |= {f"{key}.{kwargs[k]}" for k in ("key_gate", "key_up", "key_down")}
    return found


def test_mtp_head_is_quantized_as_exllamav3_does(tiny):
    qcfg = json.loads((tiny / "exl3" / "quantization_config.json").read_text())
    storage = qcfg["tensor_storage"]
    config = json.loads((tiny / "exl3" / "config.json").read_text())
    layers = config["text_config"]["mtp_num_hidden_layers"]
    assert layers == 1  # the published configs' value
    ours = {k for k, v in storage.items() if k.startswith("mtp.") and v.get("quant_format") == "exl3"}
    assert ours == expected_mtp_exl3_keys(layers)
    assert all(storage[k]["bits_per_weight"] == qcfg["mtp_bits"] for k in ours)
    # its norms are plain weights, loaded by exllamav3 under the keys it names
    for norm in ("mtp.norm", "mtp.pre_fc_norm_hidden", "mtp.pre_fc_norm_embedding", "mtp.layers.0.input_layernorm"):
        assert "quant_format" not in storage[norm] and f"{norm}.weight" in storage[norm]["stored_tensors"]
    manifest = json.loads((tiny / "manifest.json").read_text())
    assert sorted(ours) == manifest["mtp_modules"] and not set(ours) & set(manifest["exl3_modules"])


def test_exl3_tensor_names_are_what_exllamav3_loads(tiny):
    # modules/linear.py loads key + ".trellis" and optional subkeys through opt(".suh") etc.
    loads = set()
    for node in ast.walk(parse("modules/linear.py")):
        if (
            isinstance(node, ast.Constant)
            and isinstance(node.value, str)
            and node.value.startswith(".")
            and node.value[1:] in ("trellis", "suh", "svh", "su", "sv", "mcg", "mul1", "bias", "scale")
        ):
            loads.add(node.value[1:])
    assert {"trellis", "suh", "svh", "mcg", "mul1"} <= loads
    storage = json.loads((tiny / "exl3" / "quantization_config.json").read_text())["tensor_storage"]
    for prefix, entry in storage.items():
        if entry.get("quant_format") != "exl3":
            continue
        names = {n[len(prefix) + 1 :] for n in entry["stored_tensors"]}
        assert "trellis" in names and names <= loads, (prefix, names)
        assert len(names & {"mcg", "mul1"}) <= 1


def test_tensor_storage_entry_fields_match_exllamav3_writer(tiny):
    # conversion/quant_config.py: module_dict["stored_tensors" | "quant_format" | "bits_per_weight" | ...]
    fields = set()
    for node in ast.walk(parse("conversion/quant_config.py")):
        if (
            isinstance(node, ast.Subscript)
            and isinstance(node.value, ast.Name)
            and node.value.id == "module_dict"
            and isinstance(node.slice, ast.Constant)
        ):
            fields.add(node.slice.value)
    assert {"stored_tensors", "quant_format", "bits_per_weight"} <= fields
    # loader/safetensors.py list_tensors: {"shape", "n_bytes", "dtype": str(torch dtype)}
    src = (EXL / "loader" / "safetensors.py").read_text()
    assert '"dtype": str(dtype)' in src and '"n_bytes": end - beg' in src
    storage = json.loads((tiny / "exl3" / "quantization_config.json").read_text())["tensor_storage"]
    torch_dtypes = {str(d) for d in (torch.float16, torch.float32, torch.int16, torch.int32, torch.bfloat16)}
    for entry in storage.values():
        assert set(entry) <= fields
        for info in entry["stored_tensors"].values():
            assert set(info) == {"shape", "n_bytes", "dtype"} and info["dtype"] in torch_dtypes
        if entry.get("quant_format") == "exl3":
            assert isinstance(entry["bits_per_weight"], int)


READ_WITH_EXLLAMAV3 = """
import json, sys, types
sys.path.insert(0, sys.argv[1])
# exllamav3's compiled extension is CUDA code built on first import; the config reader and the
# module graph checked here are pure Python, so the extension is a stand-in in this process only.
class NoKernels(types.ModuleType):
    def __getattr__(self, name):  # modules bind kernel functions at import; none may run here
        def unavailable(*args, **kwargs):
            raise RuntimeError(f"exllamav3_ext.{name} is CUDA code, not built in this test")
        return unavailable
ext = types.ModuleType("exllamav3.ext")
ext.exllamav3_ext = NoKernels("exllamav3_ext")
sys.modules["exllamav3.ext"] = ext
from exllamav3 import Config, Model
cfg = Config.from_directory(sys.argv[2])
model = Model.from_config(cfg)
print(json.dumps({"config": type(cfg).__name__, "model": type(model).__name__, "hidden": cfg.hidden_size,
                  "layers": cfg.num_hidden_layers, "vision": cfg.vision is not None}))
"""


def read_with_exllamav3(folder: Path) -> dict:
    """What exllamav3's own Config.from_directory and Model.from_config read from ``folder`` (in a child
    process; its compiled extension stands in, see READ_WITH_EXLLAMAV3)."""
    import subprocess
    import sys

    proc = subprocess.run(
        [sys.executable, "-c", READ_WITH_EXLLAMAV3, str(EXL.parent), str(folder)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_exllamav3_reads_the_checkpoint_config(tiny):
    """exllamav3's own Config.from_directory and Model.from_config accept the writer's output (they
    refused it before the writer added the vision keys and preprocessor_config.json a published
    Qwen3.5 checkpoint carries); the numbers it reads are the writer's."""
    read = read_with_exllamav3(tiny / "exl3")
    spec = TinySpec()
    assert read == {
        "config": "Qwen3_5VLConfig",
        "model": "Qwen3_5VLModel",
        "hidden": spec.hidden,
        "layers": len(spec.layer_types),
        "vision": True,
    }


def gdn_dtype_rules() -> dict[str, set[str]]:
    """Which dtypes exllamav3's fused GDN op accepts for the checkpoint's dt_bias and A_log, read
    from its CUDA source (gdn.cu): TORCH_CHECK_DTYPE(arg, kX) or ``arg.dtype() == at::kX`` branches."""
    import re

    src = (EXL / "exllamav3_ext" / "gdn.cu").read_text()
    body = src[src.index("void gated_delta_net_fused_op_2\n") :]
    body = body[: body.index("\n}\n")]
    to_torch = {"kBFloat16": "torch.bfloat16", "kFloat": "torch.float32", "kHalf": "torch.float16"}
    rules: dict[str, set[str]] = {}
    for arg in ("dt_bias", "a_log"):
        kinds = re.findall(rf"TORCH_CHECK_DTYPE\({arg}, (k\w+)\)", body) + re.findall(
            rf"{arg}\.dtype\(\) == at::(k\w+)", body
        )
        assert kinds, f"gdn.cu no longer states the dtype of {arg}: update this test"
        rules[arg] = {to_torch[k] for k in kinds}
    return rules


def gated_norm_weight_dtypes() -> set[str]:
    """The weight dtypes of exllamav3's gated RMS norm (the GDN output norm), from the launch table of
    norm.cu: rows ``__(kX, x, kW, w, kY, y, kG, g, small, threads)`` before its "Invalid datatypes"."""
    import re

    src = (EXL / "exllamav3_ext" / "norm.cu").read_text()
    end = src.index('"gated_rms_norm: Invalid datatypes')
    body = src[src.rindex("#define __(", 0, end) : end]
    kinds = set(re.findall(r"__\(\s*k\w+,\s*\w+,\s*(k\w+),", body))
    assert kinds, "norm.cu no longer has gated_rms_norm's launch table: update this test"
    return {{"kBFloat16": "torch.bfloat16", "kFloat": "torch.float32", "kHalf": "torch.float16"}[k] for k in kinds}


def test_gdn_tensors_have_the_dtypes_exllamav3s_kernel_takes(tiny):
    """exllamav3 refused the writer's float16 dt_bias on the H200 ("dt_bias is incorrect datatype,
    must be kBFloat16", then "gated_delta_net_fused_op_2: unsupported dtype" for A_log), and after
    those its gated norm the float16 norm weight ("gated_rms_norm: Invalid datatypes for input/output")."""
    from safetensors import safe_open

    rules = {**gdn_dtype_rules(), "norm": gated_norm_weight_dtypes()}
    names = {"dt_bias": "linear_attn.dt_bias", "a_log": "linear_attn.A_log", "norm": "linear_attn.norm.weight"}
    with safe_open(str(tiny / "exl3" / "model.safetensors"), "pt") as f:
        seen = 0
        for key in f.keys():
            for arg, suffix in names.items():
                if key.endswith(suffix):
                    seen += 1
                    assert str(f.get_tensor(key).dtype) in rules[arg], (key, rules[arg])
    assert seen == 3 * sum(t == "linear_attention" for t in TinySpec().layer_types)


def test_exllamav3_output_keeps_the_source_config_dtype():
    """conversion/compile.py writes the output's config.json by loading the source model's, setting
    quantization_config (and update_config's tie_word_embeddings) and nothing else: a bfloat16
    Qwen3.5/3.6 model gives a bfloat16 EXL3 checkpoint, which is why make-tiny defaults to bfloat16."""
    compile_src = (EXL / "conversion" / "compile.py").read_text()
    tree = ast.parse(compile_src)
    fn = next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == "compile_model")
    loads = [n for n in ast.walk(fn) if isinstance(n, ast.Assign) and ast.unparse(n.value) == "json.load(f)"]
    assert [ast.unparse(t) for n in loads for t in n.targets] == ["config_dict"]
    assert 'open(os.path.join(in_dir, "config.json"), "r")' in compile_src.replace("'", '"')
    written = {
        ast.unparse(t.slice)
        for n in ast.walk(fn)
        if isinstance(n, ast.Assign)
        for t in n.targets
        if isinstance(t, ast.Subscript) and ast.unparse(t.value) == "config_dict"
    }
    assert written == {"'quantization_config'"}
    callers = {
        ast.unparse(n.func)
        for n in ast.walk(fn)
        if isinstance(n, ast.Call) and any(ast.unparse(a) == "config_dict" for a in n.args)
    }
    assert callers == {"update_config", "json.dumps"}  # updated, then written out
    update = next(
        n
        for n in ast.walk(parse("conversion/quant_config.py"))
        if isinstance(n, ast.FunctionDef) and n.name == "update_config"
    )
    keys = {
        ast.unparse(t.slice)
        for n in ast.walk(update)
        if isinstance(n, ast.Assign)
        for t in n.targets
        if isinstance(t, ast.Subscript)
    }
    assert keys == {"'tie_word_embeddings'"}
    assert "dtype" not in ast.unparse(update) and "torch_dtype" not in compile_src


def test_exllamav3_copies_the_chat_template_and_generation_config(tmp_path):
    """compile.py copies every non-tensor file of the source folder except config.json, the shard
    index and pickled weights, so a converted Qwen3.5/3.6 checkpoint carries the source's
    chat_template.jinja and generation_config.json: the writer ships both."""
    fn = next(
        n
        for n in ast.walk(parse("conversion/compile.py"))
        if isinstance(n, ast.FunctionDef) and n.name == "compile_model"
    )
    skipped_names, skipped_ends = set(), set()
    for node in ast.walk(fn):
        if isinstance(node, ast.Compare) and ast.unparse(node.left) == "f" and isinstance(node.ops[0], ast.Eq):
            skipped_names.add(node.comparators[0].value)
        if isinstance(node, ast.Call) and ast.unparse(node.func) in ("f.endswith", "f.endswith(x)"):
            skipped_ends.add(node.args[0].value) if isinstance(node.args[0], ast.Constant) else None
        if (
            isinstance(node, ast.List)
            and all(isinstance(e, ast.Constant) for e in node.elts)
            and node.elts
            and all(str(e.value).startswith(".") for e in node.elts)
        ):
            skipped_ends |= {e.value for e in node.elts}
    assert skipped_names == {"config.json", "model.safetensors.index.json"}
    assert {".safetensors", ".bin", ".pt"} <= skipped_ends
    write_tiny(tmp_path / "t", TinySpec(), dense=False)
    shipped = {p.name for p in (tmp_path / "t" / "exl3").iterdir()}
    copied = {n for n in shipped if n not in skipped_names and not n.endswith(tuple(skipped_ends))}
    assert {
        "chat_template.jinja",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "preprocessor_config.json",
    } <= copied


def allow_bf16_loads(rel: str) -> dict[str, bool]:
    """key expression -> whether exllamav3 loads it with allow_bf16=True (kept bfloat16) in ``rel``."""
    found = {}
    for node in ast.walk(parse(rel)):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get_tensor":
            flag = next((k.value for k in node.keywords if k.arg == "allow_bf16"), None)
            found[ast.unparse(node.args[0])] = isinstance(flag, ast.Constant) and flag.value is True
    return found


def test_unquantized_tensor_dtypes_are_what_exllamav3_writes(tmp_path):
    """exllamav3 saves what its modules loaded: tensors read with allow_bf16=True keep bfloat16
    (embedding, RMSNorm, the GDN conv1d / A_log / dt_bias), an unquantized Linear's weight is read
    without it and becomes float16 (in_proj_a / in_proj_b, an unquantized lm_head)."""
    from safetensors import safe_open

    assert allow_bf16_loads("modules/embedding.py")["self.key + '.weight'"]
    assert allow_bf16_loads("modules/rmsnorm.py")["self.tensor_key"]
    gdn = allow_bf16_loads("modules/gated_delta_net.py")
    assert gdn["self.key_conv1d_weight"] and gdn["self.key_a_log"] and gdn["self.key_dt_bias"]
    linear = allow_bf16_loads("modules/linear.py")
    assert not linear["key + '.weight'"] and not linear["k + '.weight'"]
    write_tiny(tmp_path / "t", TinySpec(), dense=False)
    kept = (
        "embed_tokens.weight",
        "layernorm.weight",
        "language_model.norm.weight",
        "q_norm.weight",
        "k_norm.weight",
        "conv1d.weight",
        "A_log",
        "dt_bias",
        "linear_attn.norm.weight",
    )
    with safe_open(str(tmp_path / "t" / "exl3" / "model.safetensors"), "pt") as f:
        for key in (k for k in f.keys() if "visual" not in k):
            dtype = str(f.get_slice(key).get_dtype())
            if key.endswith(kept):
                assert dtype == "BF16", key
            elif key.endswith(("in_proj_a.weight", "in_proj_b.weight", "lm_head.weight")):
                assert dtype == "F16", key
