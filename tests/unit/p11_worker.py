"""Run by test_p11_lora_utils.py in its own process (it sets up aphrodite's TP group of one, on CPU, over gloo):
the LoRA manager's ``from_layer_logits_processor`` on a real ``ParallelLMHead`` with the real ``Exl3LinearMethod``
and on an unquantized one, without and with the overlay. Prints one JSON document."""

from __future__ import annotations

import json
import socket
import sys

import torch

sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[1]))

from helpers import exl3_linear_layer  # noqa: E402


def exl3_head(vocab: int, hidden: int):
    """``ParallelLMHead(vocab, hidden, quant_config=Exl3Config(head_bits=6))`` as the loader leaves it on a GPU.
    Exl3LinearMethod.create_weights refuses a CPU, so the head is built unquantized and then given what
    create_weights registers: no ``weight``, the EXL3 placeholders (filled through aphrodite's own loader from a
    random codec linear), the real Exl3LinearMethod."""
    from aphrodite.model_executor.layers.quantization import exl3
    from aphrodite.model_executor.layers.vocab_parallel_embedding import ParallelLMHead

    from hybrid_exl3_fixes.checkpoint import codec

    head = ParallelLMHead(vocab, hidden, prefix="lm_head")
    del head.weight
    tensors = codec.random_exl3_linear(hidden, vocab, 6, "mcg", torch.Generator().manual_seed(0))
    loaded = exl3_linear_layer(exl3, None, "lm_head", {None: tensors})
    for name, param in loaded.named_parameters():
        head.register_parameter(name, param)
    head.quant_method = exl3.Exl3LinearMethod(exl3.Exl3Config(bits=3.0, head_bits=6, tensor_storage={}))
    return head


def build(manager, head) -> dict:
    from aphrodite.config.lora import LoRAConfig
    from aphrodite.model_executor.layers.logits_processor import LogitsProcessor

    config = LoRAConfig(max_lora_rank=8, max_loras=2, lora_dtype=torch.bfloat16)
    try:
        wrapper = manager.from_layer_logits_processor(LogitsProcessor(head.num_embeddings), head, 2, config, None)
    except Exception as exc:  # noqa: BLE001 - reported to the test
        return {"error": f"{type(exc).__name__}: {exc}"}
    return {
        "type": type(wrapper).__name__,
        "dtype": str(wrapper.dtype),
        "device": str(wrapper.device),
        "hidden": wrapper.hidden_size,
        "lora_a": list(wrapper.lora_a_stacked.shape),
        "lora_b": list(wrapper.lora_b_stacked.shape),
        "lora_dtype": str(wrapper.lora_b_stacked.dtype),
        "keeps_head": any(v is head for v in vars(wrapper).values()),
    }


def main() -> None:
    from aphrodite.config import AphroditeConfig, DeviceConfig, set_current_aphrodite_config
    from aphrodite.distributed import parallel_state as ps
    from aphrodite.lora import model_manager
    from aphrodite.model_executor.layers.vocab_parallel_embedding import ParallelLMHead

    import hybrid_exl3_fixes

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with set_current_aphrodite_config(AphroditeConfig(device_config=DeviceConfig(device="cpu"))):
        ps.init_distributed_environment(1, 0, f"tcp://127.0.0.1:{port}", 0, backend="gloo")
        ps.initialize_model_parallel(1, 1)
        out = {}
        hybrid_exl3_fixes.undo_all()
        out["release_exl3"] = build(model_manager, exl3_head(256, 128))
        out["release_plain"] = build(model_manager, ParallelLMHead(256, 128, prefix="lm_head"))
        results = {r.patch.id: r for r in hybrid_exl3_fixes.apply_all()}
        out["status"] = results["P11"].status.value
        out["overlay_exl3"] = build(model_manager, exl3_head(256, 128))
        out["overlay_plain"] = build(model_manager, ParallelLMHead(256, 128, prefix="lm_head"))
        ps.destroy_model_parallel()
        ps.destroy_distributed_environment()
    print(json.dumps(out))


if __name__ == "__main__":
    main()
