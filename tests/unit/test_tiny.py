"""The tiny checkpoint writer (CPU): layout, consistency, dense twin, adapters, bad input."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from hybrid_exl3_fixes.checkpoint import codec
from hybrid_exl3_fixes.checkpoint.tiny import EXL3_SUFFIXES, PRESETS, TinySpec, write_tiny
from hybrid_exl3_fixes.checkpoint.tinyspec import GDN_GATE_TARGETS


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    dest = tmp_path_factory.mktemp("t") / "tiny"
    manifest = write_tiny(dest, TinySpec(bits=3, codebook="mixed", seed=1))
    return dest, manifest


def test_layout_and_quantization_config(tiny):
    dest, manifest = tiny
    for name in (
        "exl3/config.json",
        "exl3/quantization_config.json",
        "exl3/model.safetensors",
        "exl3/tokenizer.json",
        "dense/model.safetensors",
        "lora-a/adapter_config.json",
        "lora-b/adapter_model.safetensors",
        "manifest.json",
    ):
        assert (dest / name).is_file(), name
    cfg = json.loads((dest / "exl3" / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen3_5ForConditionalGeneration"]
    assert cfg["quantization_config"]["quant_method"] == "exl3" and cfg["quantization_config"]["head_bits"] is None
    text = cfg["text_config"]
    assert text["layer_types"] == ["linear_attention"] * 3 + ["full_attention"]
    assert sum(text["rope_parameters"]["mrope_section"]) == text["head_dim"] * text["partial_rotary_factor"] / 2
    # 3 GDN layers x 3 + 1 attention layer x 4 + 4 MLPs x 3
    assert len(manifest["exl3_modules"]) == 3 * 3 + 4 + 4 * 3
    assert set(manifest["codebooks"].values()) == set(codec.CODEBOOKS)


def test_tensor_storage_matches_the_safetensors(tiny):
    dest, manifest = tiny
    storage = json.loads((dest / "exl3" / "quantization_config.json").read_text())["tensor_storage"]
    tensors = load_file(str(dest / "exl3" / "model.safetensors"))
    plain = {k: v for k, v in storage.items() if "quant_format" not in v}
    assert "model.language_model.layers.0.linear_attn.in_proj_a" in plain and "lm_head" in plain
    for entry in plain.values():
        assert all(list(tensors[n].shape) == i["shape"] for n, i in entry["stored_tensors"].items())
    mtp = {k for k, v in storage.items() if k.startswith("mtp.") and "quant_format" in v}
    assert mtp == set(manifest["mtp_modules"]) and mtp  # the MTP head, at mtp_bits (test_exllamav3_layout)
    for prefix, entry in storage.items():
        if prefix in plain:
            continue
        if prefix in mtp:
            assert entry["quant_format"] == "exl3" and entry["bits_per_weight"] == TinySpec().mtp_bits
        else:
            assert entry["quant_format"] == "exl3" and entry["bits_per_weight"] == 3
            assert prefix.startswith("model.language_model.layers.")
            assert prefix.split(".", 4)[-1] in EXL3_SUFFIXES, prefix
        for name, info in entry["stored_tensors"].items():
            assert list(tensors[name].shape) == info["shape"], name
        fin = tensors[prefix + ".suh"].shape[0]
        fout = tensors[prefix + ".svh"].shape[0]
        bits = entry["bits_per_weight"]
        assert tensors[prefix + ".trellis"].shape == (fin // 16, fout // 16, 16 * bits)
        assert fin % 128 == 0 and fout % 128 == 0
        has = {m for m in ("mcg", "mul1") if prefix + "." + m in tensors}
        assert len(has) <= 1
    unquantized = [k for k in tensors if k.endswith("in_proj_a.weight") or k.endswith("in_proj_b.weight")]
    assert unquantized and all(tensors[k].dtype == torch.float16 for k in unquantized)


# name suffix -> dtype in a bfloat16 checkpoint (the default) and in a --dtype float16 one
DTYPE_RULES = {
    "embed_tokens.weight": ("bfloat16", "float16"),
    "layernorm.weight": ("bfloat16", "float16"),
    "language_model.norm.weight": ("bfloat16", "float16"),
    "conv1d.weight": ("bfloat16", "float16"),
    "q_norm.weight": ("bfloat16", "float16"),
    "in_proj_a.weight": ("float16", "float16"),
    "lm_head.weight": ("float16", "float16"),
    "linear_attn.dt_bias": ("bfloat16", "bfloat16"),
    "linear_attn.A_log": ("bfloat16", "bfloat16"),
    "linear_attn.norm.weight": ("bfloat16", "bfloat16"),
    ".suh": ("float16", "float16"),
    ".trellis": ("int16", "int16"),
}


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_config_and_tensor_dtypes_follow_the_checkpoint_dtype(tmp_path, dtype):
    """bfloat16 by default, as exllamav3 writes a Qwen3.5/3.6 model; --dtype float16 writes the
    checkpoints of this project's earlier GPU runs (float16 config, float16 tensors but the GDN trio)."""
    manifest = write_tiny(tmp_path / "t", TinySpec(dtype=dtype), dense=False)
    cfg = json.loads((tmp_path / "t" / "exl3" / "config.json").read_text())
    # the published configs name the dtype in text_config only (tests/data/published)
    assert "dtype" not in cfg and cfg["text_config"]["dtype"] == dtype and manifest["spec"]["dtype"] == dtype
    tensors = load_file(str(tmp_path / "t" / "exl3" / "model.safetensors"))
    column = 0 if dtype == "bfloat16" else 1
    for suffix, dtypes in DTYPE_RULES.items():
        names = [k for k in tensors if k.endswith(suffix) and "visual" not in k]
        assert names, suffix
        assert {str(tensors[k].dtype) for k in names} == {f"torch.{dtypes[column]}"}, suffix


def test_default_dtype_is_bfloat16_and_an_unknown_one_is_refused(tmp_path):
    assert TinySpec().dtype == "bfloat16"
    with pytest.raises(ValueError, match="dtype must be one of bfloat16, float16"):
        write_tiny(tmp_path / "x", TinySpec(dtype="float32"))
    assert list(tmp_path.iterdir()) == []


def test_chat_template_and_generation_config(tiny):
    """The folder carries what a Qwen3.5/3.6 checkpoint carries: chat_template.jinja (ChatML,
    enable_thinking) and generation_config.json; HF's tokenizer renders it as the server will."""
    from transformers import AutoTokenizer

    dest, _ = tiny
    for folder in ("exl3", "dense"):
        assert (dest / folder / "chat_template.jinja").is_file()
        gen = json.loads((dest / folder / "generation_config.json").read_text())
        assert gen["eos_token_id"] == [506, 504] and gen["top_k"] == 20
    tok = AutoTokenizer.from_pretrained(dest / "exl3")
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "<think>\nhmm\n</think>\n\nHello"},
        {"role": "user", "content": [{"type": "text", "text": "this: "}, {"type": "image"}]},
    ]
    off = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, enable_thinking=False)
    on = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, enable_thinking=True)
    assert off == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\nHello<|im_end|>\n"  # history reasoning dropped
        "<|im_start|>user\nthis: <|vision_start|><|image_pad|><|vision_end|><|im_end|>\n"
        "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    )
    assert on == off[: -len("<think>\n\n</think>\n\n")]
    ids = tok.apply_chat_template(messages[1:2], add_generation_prompt=True, enable_thinking=False, return_dict=False)
    assert ids[-6:] == [507, 198, 198, 508, 198, 198]  # <think> \n \n </think> \n \n: single tokens
    # a tool turn after the last user query keeps its reasoning
    tools = [{"type": "function", "function": {"name": "now", "parameters": {"type": "object"}}}]
    turn = [
        {"role": "user", "content": "time?"},
        {
            "role": "assistant",
            "reasoning_content": "ask the clock",
            "content": "",
            "tool_calls": [{"function": {"name": "now", "arguments": {}}}],
        },
        {"role": "tool", "content": "12:00"},
    ]
    text = tok.apply_chat_template(turn, tools=tools, tokenize=False, add_generation_prompt=True)
    assert '"name": "now"' in text and "<think>\nask the clock\n</think>" in text
    assert "<tool_response>\n12:00\n</tool_response><|im_end|>" in text


def test_dense_twin_holds_the_decoded_weights(tiny):
    dest, manifest = tiny
    exl3 = load_file(str(dest / "exl3" / "model.safetensors"))
    dense = load_file(str(dest / "dense" / "model.safetensors"))
    for prefix in manifest["exl3_modules"][:5]:
        parts = {k.rsplit(".", 1)[1]: v for k, v in exl3.items() if k.startswith(prefix + ".")}
        assert torch.equal(dense[prefix + ".weight"], codec.dense_weight(parts, 3).t().contiguous())
    assert torch.equal(dense["lm_head.weight"], exl3["lm_head.weight"].float())


def test_dense_twin_loads_in_transformers(tiny):
    from transformers import AutoTokenizer, Qwen3_5ForConditionalGeneration

    dest, _ = tiny
    model, info = Qwen3_5ForConditionalGeneration.from_pretrained(dest / "dense", output_loading_info=True)
    assert not any(info.values()), info
    tok = AutoTokenizer.from_pretrained(dest / "dense")
    ids = tok("hybrid EXL3").input_ids
    assert tok.decode(ids) == "hybrid EXL3"
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits
    assert logits.shape == (1, len(ids), 512) and torch.isfinite(logits).all()


def test_adapters_have_nonzero_b_over_the_exl3_projections(tiny):
    dest, manifest = tiny
    for name in ("lora-a", "lora-b"):
        cfg = json.loads((dest / name / "adapter_config.json").read_text())
        assert cfg["peft_type"] == "LORA" and cfg["r"] == 8
        state = load_file(str(dest / name / "adapter_model.safetensors"))
        b = [v for k, v in state.items() if k.endswith("lora_B.weight")]
        assert len(b) == len(manifest["exl3_modules"]) and all(v.abs().sum() > 0 for v in b)
    a = load_file(str(dest / "lora-a" / "adapter_model.safetensors"))
    b = load_file(str(dest / "lora-b" / "adapter_model.safetensors"))
    assert not torch.equal(next(iter(a.values())), next(iter(b.values())))


def test_tp_split_that_cuts_a_hadamard_block_is_refused(tmp_path):
    with pytest.raises(ValueError, match="would cut a 128-wide Hadamard block"):
        write_tiny(tmp_path / "x", TinySpec(tp=4))  # GDN key dim 256 / 4 = 64
    assert not (tmp_path / "x").exists() and list(tmp_path.iterdir()) == []


def test_non_empty_target_is_refused_and_untouched(tmp_path):
    target = tmp_path / "busy"
    target.mkdir()
    (target / "keep.txt").write_text("mine")
    with pytest.raises(FileExistsError):
        write_tiny(target)
    assert [p.name for p in target.iterdir()] == ["keep.txt"]
    assert [p.name for p in tmp_path.iterdir()] == ["busy"]


def test_unknown_codebook_is_refused(tmp_path):
    with pytest.raises(ValueError, match="codebook"):
        write_tiny(tmp_path / "x", TinySpec(codebook="foo"))


def test_make_tiny_cli(tmp_path):
    from hybrid_exl3_fixes.cli import main

    assert main(["make-tiny", str(tmp_path / "a"), "--bits", "2", "--codebook", "3inst"]) == 0
    assert (tmp_path / "a" / "exl3" / "model.safetensors").is_file()
    assert json.loads((tmp_path / "a" / "exl3" / "config.json").read_text())["text_config"]["dtype"] == "bfloat16"
    assert main(["make-tiny", str(tmp_path / "f"), "--dtype", "float16", "--no-dense"]) == 0
    assert json.loads((tmp_path / "f" / "exl3" / "config.json").read_text())["text_config"]["dtype"] == "float16"
    assert main(["make-tiny", str(tmp_path / "a")]) == 2  # not empty: refused
    assert main(["make-tiny", str(tmp_path / "b"), "--tp", "4"]) == 2
    assert not (tmp_path / "b").exists()


def test_packing_device_does_not_change_the_tensors():
    """make-tiny --device packs and decodes elsewhere; the draws stay on the CPU generator, so the
    EXL3 tensors are bit-identical (and the dense weights equal) whatever device is named."""
    a = codec.random_exl3_linear(256, 128, 3, "mul1", torch.Generator().manual_seed(5))
    b = codec.random_exl3_linear(256, 128, 3, "mul1", torch.Generator().manual_seed(5), device="cpu")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert torch.equal(codec.dense_weight(a, 3), codec.dense_weight(b, 3, device="cpu"))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_make_tiny_refuses_a_device_torch_cannot_use(tmp_path, capsys):
    from hybrid_exl3_fixes.cli import main

    assert main(["make-tiny", str(tmp_path / "c"), "--device", "cuda"]) == 2
    assert "no CUDA device" in capsys.readouterr().err
    assert main(["make-tiny", str(tmp_path / "c"), "--device", "nonsense"]) == 2
    assert list(tmp_path.iterdir()) == []


def test_no_dense_writes_the_same_exl3_checkpoint(tmp_path, tiny):
    """--no-dense (benchmarks) leaves out dense/ and nothing else: the EXL3 tensors are the same."""
    dest, _ = tiny
    write_tiny(tmp_path / "n", TinySpec(bits=3, codebook="mixed", seed=1), dense=False)
    assert sorted(p.name for p in (tmp_path / "n").iterdir()) == sorted(
        p.name for p in dest.iterdir() if p.name != "dense"
    )
    a, b = (
        load_file(str(dest / "exl3" / "model.safetensors")),
        load_file(str(tmp_path / "n" / "exl3" / "model.safetensors")),
    )
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def on_screen(err: str) -> str:
    """What a terminal shows of ``err``: each line from its last carriage return, blank lines dropped.
    On a slow machine (CI's two lanes) make-tiny's bar appears after 2 s and, leave=False, erases
    itself with ``\\r`` before the error line; the user sees one line."""
    lines = (line.rsplit("\r", 1)[-1].strip() for line in err.split("\n"))
    return "\n".join(line for line in lines if line)


@pytest.mark.parametrize("where", ["under a file", "a file", "full disk"])
def test_make_tiny_failures_are_one_line_and_leave_nothing(tmp_path, capsys, monkeypatch, where):
    """A folder it cannot create, a target that is a file, a disk that fills up half-way: exit 2, one
    line naming the problem, and the parent folder exactly as it was."""
    import errno

    import safetensors.torch

    from hybrid_exl3_fixes.cli import main

    (tmp_path / "file").write_text("x")
    target = {"under a file": tmp_path / "file" / "m", "a file": tmp_path / "file", "full disk": tmp_path / "m"}[where]
    if where == "full disk":

        def full(*args, **kwargs):
            raise OSError(errno.ENOSPC, "No space left on device")

        monkeypatch.setattr(safetensors.torch, "save_file", full)
    assert main(["make-tiny", str(target), "--no-dense"]) == 2
    err = on_screen(capsys.readouterr().err)
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert {"under a file": "cannot create", "a file": "is not a folder", "full disk": "No space left"}[where] in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]


def test_progress_bar_appears_only_for_long_work(capsys):
    """make-tiny's bar (tqdm, on stderr) shows once the work has taken 2 s: the tiny preset stays
    quiet, the 27B-width one (minutes on a CPU) shows it."""
    import time

    from hybrid_exl3_fixes.checkpoint.tiny import progress

    list(progress(list(range(3)), "quick"))
    assert capsys.readouterr().err == ""
    for _ in progress(list(range(3)), "slow"):
        time.sleep(1.1)
    assert "make-tiny: slow" in capsys.readouterr().err


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_every_preset_splits_into_whole_hadamard_blocks_at_tp2(preset):
    """Tensor parallel 2: every preset's column- and row-split dimensions are multiples of
    128 x 2, so each rank of a TP=2 engine holds whole Hadamard blocks; TP=4 is refused where it would not."""
    from hybrid_exl3_fixes.checkpoint.tiny import _check

    _check(TinySpec.preset(preset, tp=2))


@pytest.mark.parametrize("preset", ["tiny", "tiny-moe"])
def test_doctor_agrees_at_tp2(tmp_path, preset):
    from hybrid_exl3_fixes.doctor import diagnose

    write_tiny(tmp_path / "m", TinySpec.preset(preset), dense=False)
    report = diagnose(tmp_path / "m" / "exl3", tp=2, language_model_only=True, check_overlay=False)
    assert {f.check: f.level for f in report.findings}["tp-alignment"] == "OK"
    report = diagnose(tmp_path / "m" / "exl3", tp=4, language_model_only=True, check_overlay=False)
    assert {f.check: f.level for f in report.findings}["tp-alignment"] == "BLOCK"


def test_lora_ab_adapts_the_gdn_gates_as_fine_tuning_tools_write_it(tiny):
    """lora-ab: the trunk targets plus in_proj_a / in_proj_b (plain linears in EXL3, hidden -> GDN value heads),
    as adapters trained with megatron-swift and VeOmni carry them; PEFT loads it onto the dense twin."""
    dest, manifest = tiny
    cfg = json.loads((dest / "lora-ab" / "adapter_config.json").read_text())
    assert {"in_proj_a", "in_proj_b"} <= set(cfg["target_modules"]) and set(cfg["target_modules"]) > {"in_proj_qkv"}
    state = load_file(str(dest / "lora-ab" / "adapter_model.safetensors"))
    spec = TinySpec(bits=3, codebook="mixed", seed=1)
    gdn_layers = [n for n, t in enumerate(spec.layer_types) if t == "linear_attention"]
    for n in gdn_layers:
        for proj in ("in_proj_a", "in_proj_b"):
            key = f"base_model.model.model.language_model.layers.{n}.linear_attn.{proj}"
            assert state[f"{key}.lora_A.weight"].shape == (cfg["r"], spec.hidden)
            assert state[f"{key}.lora_B.weight"].shape == (spec.gdn_value_heads, cfg["r"])
            assert state[f"{key}.lora_B.weight"].abs().sum() > 0
    assert not any(k.startswith("base_model.model.mtp.") for k in state)  # aphrodite does not load the MTP head
    assert len([k for k in state if k.endswith("lora_B.weight")]) == len(manifest["exl3_modules"]) + 2 * len(gdn_layers)


def test_lora_ab_loads_in_peft_on_the_dense_twin(tiny):
    peft = pytest.importorskip("peft", reason="peft is the reference the GPU suite compares against")
    from transformers import AutoModelForImageTextToText

    dest, _ = tiny
    model = AutoModelForImageTextToText.from_pretrained(str(dest / "dense"), dtype=torch.float32)
    wrapped = peft.PeftModel.from_pretrained(model, str(dest / "lora-ab"))
    names = {n for n, _ in wrapped.named_modules() if n.endswith("in_proj_a") or n.endswith("in_proj_b")}
    assert names and all(hasattr(wrapped.get_submodule(n), "lora_A") for n in names)


SERVER_TOLERANCE = 0.15  # tests/gpu/test_server.py TOLERANCE


def lora_off(model, suffixes: tuple[str, ...] = ("",)) -> None:
    """Scale to zero every LoRA module of the PEFT ``model`` whose name ends with one of ``suffixes`` (all by
    default); asserts there is one."""
    mods = [m for n, m in model.named_modules() if n.endswith(suffixes) and isinstance(getattr(m, "scaling", 0), dict)]
    assert mods
    for m in mods:
        m.scaling = {k: 0.0 for k in m.scaling}


def served_distance(folder, adapter: str, n_prompts: int, switch_off) -> float:
    """The server cells' own measure between HF + PEFT's reference with ``adapter`` on ``folder``'s dense twin and
    the same model after ``switch_off(model)``: max |d logprob| over the top-5 entries (of the reference with the
    adapter) of every prompt and generated position (harness.compare_served), on the cells' prompts
    (test_server.prompts(n_prompts, 1)) with their 8 greedy tokens (complete(): max_tokens 8)."""
    peft = pytest.importorskip("peft", reason="peft is the reference the GPU suite compares against")
    import random

    from transformers import AutoModelForImageTextToText

    base = AutoModelForImageTextToText.from_pretrained(str(folder / "dense"), dtype=torch.float32)
    model = peft.PeftModel.from_pretrained(base, str(folder / adapter)).eval()
    rng = random.Random(1)  # tests/gpu/test_server.py prompts(n, 1)
    prompts = [[rng.randrange(0, 500) for _ in range(rng.randrange(12, 48))] for _ in range(n_prompts)]

    def logprobs(ids):
        with torch.no_grad():
            return model(input_ids=torch.tensor([ids])).logits[0].log_softmax(-1)

    answers = []
    for ids in prompts:
        ids = list(ids)
        for _ in range(8):
            ids.append(int(logprobs(ids)[-1].argmax()))
        answers.append(ids[:-1])
    on = [logprobs(ids) for ids in answers]
    switch_off(model)
    off = [logprobs(ids) for ids in answers]
    top5 = [a.topk(5, -1).indices for a in on]
    return max(float((a.gather(1, t) - b.gather(1, t)).abs().max()) for a, b, t in zip(on, off, top5))


def test_lora_ab_gate_deltas_are_visible_beyond_the_server_tolerance(tmp_path):
    """The server cell that serves lora-ab tells an engine that drops its in_proj_a / in_proj_b deltas from one
    that applies them (tests/gpu/test_server.py: GATES_OFF > TOLERANCE) only if HF + PEFT's references with and
    without those deltas are more than two tolerances apart by the cell's own measure (served_distance) on the
    cell's three prompts, on the server suite's checkpoint. The full-vocabulary distance overstates it (0.66
    against 0.38 here): the server reports the top 5 only."""
    write_tiny(tmp_path / "t", TinySpec(bits=4, codebook="mcg", seed=0), dense=True)
    distance = served_distance(tmp_path / "t", "lora-ab", 3, lambda model: lora_off(model, GDN_GATE_TARGETS))
    assert distance > 2 * SERVER_TOLERANCE, distance


@pytest.mark.parametrize("head_bits", [None, 6])
def test_lora_a_moves_the_served_logprobs_beyond_three_tolerances(tmp_path, head_bits):
    """Every LoRA server cell asserts that lora-a is more than three tolerances from the base reference on its
    first prompt ("the adapter made no difference"), so that an engine that served the base model for the adapter
    could not pass. That must hold on each checkpoint the cells serve: the float16 head's and the EXL3 head's
    (compiled-bf16-lora-exl3head). An EXL3 head drawn at codec.random_exl3_linear's default scale (0.02, against the
    float16 head's 0.1) gives logits five times flatter, and lora-a moved the top-5 logprobs by only 0.13."""
    spec = TinySpec(bits=4, codebook="mcg", seed=0, head_bits=head_bits)  # the server suite's checkpoints
    write_tiny(tmp_path / "t", spec, dense=True)
    distance = served_distance(tmp_path / "t", "lora-a", 1, lora_off)
    assert distance > 3 * SERVER_TOLERANCE, distance


def test_an_exl3_head_as_exllamav3_writes_it_with_its_dense_twin(tmp_path):
    """``head_bits``: the head in EXL3 (its storage entry, no ``lm_head.weight``) and the dense twin's head the
    dequantized weight."""
    import torch
    from safetensors.torch import load_file

    from hybrid_exl3_fixes.checkpoint import codec
    from hybrid_exl3_fixes.checkpoint.tiny import TinySpec, write_tiny

    write_tiny(tmp_path / "head", TinySpec(bits=4, codebook="mcg", seed=0, head_bits=6, adapters=()))
    cfg = json.loads((tmp_path / "head" / "exl3" / "config.json").read_text())
    assert cfg["quantization_config"]["head_bits"] == 6
    exl3 = load_file(tmp_path / "head" / "exl3" / "model.safetensors")
    dense = load_file(tmp_path / "head" / "dense" / "model.safetensors")
    assert "lm_head.weight" not in exl3 and {"lm_head.trellis", "lm_head.suh", "lm_head.svh"} <= set(exl3)
    head = {k.removeprefix("lm_head."): v for k, v in exl3.items() if k.startswith("lm_head.")}
    assert torch.equal(dense["lm_head.weight"], codec.dense_weight(head, 6).t().contiguous())
    manifest = json.loads((tmp_path / "head" / "manifest.json").read_text())
    assert manifest["codebooks"]["lm_head"] == "mcg"


def test_an_exl3_head_needs_a_vocabulary_of_128s(tmp_path):
    from hybrid_exl3_fixes.checkpoint.tiny import TinySpec, write_tiny

    with pytest.raises(ValueError, match="multiple of 128"):
        write_tiny(tmp_path / "x", TinySpec(vocab=500, head_bits=6))
    assert not (tmp_path / "x").exists()
