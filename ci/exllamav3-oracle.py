"""Issue 9 on the GPU: exllamav3 1.6.5, the format's owner, as an oracle nobody here wrote.

    python3 ci/exllamav3-oracle.py read WORK       exllamav3 loads tiny EXL3 checkpoints from this
                                                   project's writer (3INST, mcg, mul1); logits vs HF
                                                   transformers on each dense twin
    python3 ci/exllamav3-oracle.py read-aphrodite WORK
                                                   aphrodite 0.21.0 + the overlay on the same three
                                                   checkpoints; prompt logprobs vs exllamav3's (saved
                                                   by read)
    python3 ci/exllamav3-oracle.py convert WORK    exllamav3's converter quantizes a tiny dense twin
                                                   (calibration: its bundled text); its own forward on
                                                   the result is saved to WORK/exl3-own.json
    python3 ci/exllamav3-oracle.py aphrodite WORK  aphrodite 0.21.0 + the overlay (LoRA on) loads that
                                                   result; prompt logprobs vs exllamav3's saved ones

exllamav3 must be importable with its built extension (ci/exllamav3-build.py); each step prints
``RESULT {json}`` lines.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
PROMPTS = [
    [51, 71, 68, 220, 71, 88, 300, 12, 45, 77, 9, 301],
    [36, 55, 43, 18, 220, 83, 90, 91, 400, 3],
    [43, 78, 49, 32, 220, 64, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16],
]
TOP = 20


def result(**values) -> None:
    print("RESULT " + json.dumps(values), flush=True)


def hf_logprobs(dense: Path) -> list[torch.Tensor]:
    from transformers import Qwen3_5ForConditionalGeneration

    model = Qwen3_5ForConditionalGeneration.from_pretrained(dense, dtype=torch.float32).cuda().eval()
    with torch.no_grad():
        out = [model(input_ids=torch.tensor([ids]).cuda()).logits[0].float().log_softmax(-1).cpu() for ids in PROMPTS]
    del model
    torch.cuda.empty_cache()
    return out


def exl3_logprobs(model_dir: Path) -> list[torch.Tensor]:
    from exllamav3 import Config, Model

    config = Config.from_directory(str(model_dir))
    model = Model.from_config(config)
    model.load(device="cuda:0")
    out = [
        model.forward(torch.tensor([ids]), {"attn_mode": "flash_attn_nc"})[0].float().log_softmax(-1).cpu()
        for ids in PROMPTS
    ]
    model.unload()
    return out


def compare(got: list[torch.Tensor], ref: list[torch.Tensor]) -> dict:
    """max |d logprob| over ``got``'s top 20 at every position, and argmax agreement."""
    worst, agree, positions = 0.0, 0, 0
    for g, r in zip(got, ref):
        top = g.topk(TOP, dim=-1).indices
        worst = max(worst, float((g.gather(-1, top) - r[: g.shape[0]].gather(-1, top)).abs().max()))
        agree += int((g.argmax(-1) == r[: g.shape[0]].argmax(-1)).sum())
        positions += g.shape[0]
    return {"max_abs_dlogprob": worst, "argmax_agree": f"{agree}/{positions}"}


def step_read(work: Path) -> None:
    from hybrid_exl3_fixes.checkpoint.tiny import TinySpec, write_tiny

    for codebook in ("mcg", "mul1", "3inst"):
        tiny = work / f"tiny-{codebook}"
        if not (tiny / "manifest.json").exists():
            write_tiny(tiny, TinySpec(bits=4, codebook=codebook, seed=0))
        got, ref = exl3_logprobs(tiny / "exl3"), hf_logprobs(tiny / "dense")
        (tiny / "exllamav3-own.json").write_text(json.dumps([lp.tolist() for lp in got]))
        result(step="read", codebook=codebook, **compare(got, ref))


def step_read_aphrodite(work: Path) -> None:
    for codebook in ("mcg", "mul1", "3inst"):
        tiny = work / f"tiny-{codebook}"
        own = [torch.tensor(x) for x in json.loads((tiny / "exllamav3-own.json").read_text())]
        case = {
            "model": str(tiny / "exl3"),
            "quantization": "exl3",
            "prompts": PROMPTS,
            "loras": [None] * 3,
            "batches": [[0], [1], [2]],
        }
        aphrodite_vs(own, case, work, f"aphrodite-reads-ours-{codebook}", step="read-aphrodite", codebook=codebook)


def step_convert(work: Path) -> None:
    from hybrid_exl3_fixes.checkpoint.tiny import TinySpec, write_tiny

    tiny = work / "tiny-mcg"
    if not (tiny / "manifest.json").exists():
        write_tiny(tiny, TinySpec(bits=4, codebook="mcg", seed=0))
    # exllamav3's converter runs the source model for calibration, and its GDN kernel takes dt_bias
    # only in bfloat16: convert a bfloat16 copy of the dense twin, as published Qwen3.5 checkpoints are.
    source = bf16_copy(tiny / "dense", work / "dense-bf16")
    out, scratch = work / "converted", work / "convert-work"
    cmd = [
        sys.executable,
        "-m",
        "exllamav3.conversion.convert_model",
        "-i",
        str(source),
        "-o",
        str(out),
        "-w",
        str(scratch),
        "-b",
        "4",
        "-cr",
        "16",
        "-cc",
        "256",
        "-vb",
        "16",
    ]
    start = time.time()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    (work / "convert.log").write_text(proc.stdout + proc.stderr)
    print((proc.stdout + proc.stderr)[-3000:], flush=True)
    if proc.returncode != 0 or not (out / "config.json").exists():
        result(step="convert", ok=False, exit=proc.returncode)
        return
    storage = json.loads((out / "quantization_config.json").read_text()).get("tensor_storage", {})
    quantized = sorted(k for k, v in storage.items() if v.get("quant_format") == "exl3")
    own = exl3_logprobs(out)
    (work / "exl3-own.json").write_text(json.dumps([lp.tolist() for lp in own]))
    result(
        step="convert",
        ok=True,
        seconds=round(time.time() - start, 1),
        exl3_tensors=len(quantized),
        example=quantized[:3],
        vs_dense_twin=compare(own, hf_logprobs(tiny / "dense")),
    )


def bf16_copy(src: Path, dst: Path) -> Path:
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst, dirs_exist_ok=True)
    state = load_file(str(dst / "model.safetensors"))
    save_file(
        {k: v.to(torch.bfloat16) for k, v in state.items()}, str(dst / "model.safetensors"), metadata={"format": "pt"}
    )
    config = json.loads((dst / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**config, "dtype": "bfloat16"}, indent=2))
    return dst


def step_aphrodite(work: Path) -> None:
    own = [torch.tensor(x) for x in json.loads((work / "exl3-own.json").read_text())]
    case = {
        "model": str(work / "converted"),
        "quantization": "exl3",
        "enable_lora": True,
        "prompts": PROMPTS,
        "loras": [None, "lora-a", None],
        "adapters": {"lora-a": str(work / "tiny-mcg" / "lora-a")},
        "batches": [[0], [1], [2]],
    }
    aphrodite_vs(own, case, work, "aphrodite-reads-exllamav3", step="aphrodite")


def aphrodite_vs(own: list[torch.Tensor], case: dict, work: Path, name: str, **labels) -> None:
    """Run aphrodite (+ the overlay) on ``case`` in its own process; prompt logprobs vs exllamav3's ``own``."""
    sys.path.insert(0, str(HERE.parent / "tests" / "gpu"))
    from harness import compare as compare_prompt_logprobs
    from harness import run_engine

    res = run_engine(case, work, name)
    if not res["ok"]:
        print(res["output"][-4000:])
        result(**labels, ok=False, error=res.get("error"))
        return
    rows = []
    for out in res["outputs"]:
        c = compare_prompt_logprobs(out["prompt_logprobs"], own[out["index"]])
        rows.append(
            {
                "prompt": out["index"],
                "lora": out["lora"],
                "max_abs_dlogprob_vs_exllamav3": c["max_abs_dlogprob"],
                "argmax_agree": f"{c['argmax_agree']}/{c['positions']}",
            }
        )
    result(
        **labels,
        ok=True,
        start_s=res["start_s"],
        requests=rows,
        overlay_summary=sorted(set(re.findall(r"hybrid-exl3-fixes: (applied=[^\n]*)", res["output"]))),
    )


if __name__ == "__main__":
    step, work = sys.argv[1], Path(sys.argv[2])
    work.mkdir(parents=True, exist_ok=True)
    {"read": step_read, "read-aphrodite": step_read_aphrodite, "convert": step_convert, "aphrodite": step_aphrodite}[
        step
    ](work)
