"""One Aphrodite engine run in its own process (the engine in its normal multiprocess mode).

Usage: python engine_case.py CASE.json  ->  prints one line ``RESULT {json}``.
CASE: {"model": dir, "enable_lora": bool, "prompts": [[ids...]], "loras": [name or null per prompt],
       "adapters": {name: dir}, "max_loras": int, "tp": int, "logprobs": int}
The overlay reaches this process and the engine's through aphrodite's plugin loader; tests switch
it off with HYBRID_EXL3_FIXES_DISABLE in this process's environment.
"""

import json
import sys
import time
import traceback


def main() -> None:
    case = json.load(open(sys.argv[1]))
    from aphrodite import LLM, SamplingParams
    from aphrodite.lora.request import LoRARequest

    started = time.time()
    kwargs = dict(
        model=case["model"],
        quantization=case.get("quantization"),
        enforce_eager=True,
        max_model_len=512,
        gpu_memory_utilization=case.get("gpu_memory_utilization", 0.25),
        attention_backend="TRITON_ATTN",
        gdn_prefill_backend="triton",
        language_model_only=True,
        tensor_parallel_size=case.get("tp", 1),
        seed=0,
    )
    if case.get("enable_lora"):
        kwargs.update(enable_lora=True, max_lora_rank=8, max_loras=case.get("max_loras", 2))
    try:
        llm = LLM(**kwargs)
    except BaseException as exc:  # the engine core's real error is in this process's output too
        print(
            "RESULT "
            + json.dumps(
                {
                    "ok": False,
                    "stage": "start",
                    "error": f"{type(exc).__name__}: {exc}",
                    "traceback": traceback.format_exc()[-4000:],
                }
            ),
            flush=True,
        )
        return
    start_s = time.time() - started
    ids = {name: i + 1 for i, name in enumerate(sorted(case.get("adapters", {})))}
    requests = [LoRARequest(name, ids[name], case["adapters"][name]) if name else None for name in case["loras"]]
    params = SamplingParams(
        max_tokens=case.get("max_tokens", 8), temperature=0.0, prompt_logprobs=case.get("logprobs", 20)
    )
    outputs = []
    for batch in case.get("batches", [list(range(len(case["prompts"])))]):
        prompts = [{"prompt_token_ids": case["prompts"][i]} for i in batch]
        lora = [requests[i] for i in batch] if case.get("enable_lora") else None
        for i, out in zip(batch, llm.generate(prompts, params, lora_request=lora, use_tqdm=False)):
            plp = [None if d is None else {str(t): lp.logprob for t, lp in d.items()} for d in out.prompt_logprobs]
            outputs.append(
                {
                    "index": i,
                    "lora": case["loras"][i],
                    "prompt_logprobs": plp,
                    "generated": list(out.outputs[0].token_ids),
                }
            )
    print("RESULT " + json.dumps({"ok": True, "start_s": start_s, "outputs": outputs}), flush=True)


if __name__ == "__main__":
    main()
