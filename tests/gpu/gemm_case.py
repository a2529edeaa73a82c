"""A sequence of EXL3 GEMM calls in one fresh process (aphrodite's kernel cache lives as long as
the process), each checked against the project's reference codec.

Usage: python gemm_case.py CASE.json  ->  prints one line ``RESULT {json}``.
CASE: {"calls": [{"k", "n", "K", "codebook", "rows", "path"}], "overlay": bool}
path:
  linear_one   aphrodite's ``exl3_linear_one`` op (exl3_gemm at <= 32 rows, reconstruct above)
  gemm_fp32    ``exl3_gemm`` into a float32 output
  mgemm        ``exl3_mgemm`` over two matrices of the call's shape and codebook (fused k/v path)
  forced       ``exl3_gemm`` with force_shape_idx/force_num_sms (the overlay's uncached launch)
  layer        a real ``Exl3LinearMethod`` layer, loaded and applied; with ``"overlay": true`` the
               overlay's patches are applied first (P3 plans each load)
Every call of one (k, n, K) uses the same trellis, suh and svh: only its codebook flag differs, as
for two layers of one shape. Each result names the codebook whose reference ``x @ W`` the output
matches (``decoded_as``, "?" for none) and the relative error against its own codebook's.
"""

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: helpers


def main() -> None:
    case = json.load(open(sys.argv[1]))
    if case.get("overlay"):
        import hybrid_exl3_fixes

        results = {r.patch.id: r.status.value for r in hybrid_exl3_fixes.apply_all()}
        assert results.get("P3") == "APPLIED", results
    import aphrodite._custom_ops as ops
    import aphrodite.model_executor.layers.quantization.exl3 as exl3

    from helpers import exl3_linear_layer
    from hybrid_exl3_fixes.aphrodite.model_executor.layers.quantization.exl3 import p3_gemm_cache as p13
    from hybrid_exl3_fixes.checkpoint import codec
    from hybrid_exl3_fixes.decisions import exl3_kernels as kernels

    flags = p13.CODEBOOK_FLAGS
    weights: dict = {}

    def tensors_for(k, n, K, seed=0):
        key = (k, n, K, seed)
        if key not in weights:
            gen = torch.Generator().manual_seed(hash(key) % (1 << 31))
            base = codec.random_exl3_linear(k, n, K, "3inst", gen)
            dense = {cb: codec.dense_weight({**base, **codec.marker_tensors(cb)}, K).cuda() for cb in flags}
            weights[key] = ({name: t.cuda() for name, t in base.items()}, dense)
        return weights[key]

    def decoded(y, dense, x, own):
        errs = {cb: float((y.float() - x.float() @ w).norm() / (x.float() @ w).norm()) for cb, w in dense.items()}
        best = min(errs, key=errs.get)
        return (best if errs[best] < kernels.SAME else "?"), errs[own]

    props = torch.cuda.get_device_properties(0)
    cc = kernels.compute_class(props.major, props.minor)
    out = []
    for i, call in enumerate(case["calls"]):
        k, n, K, cb, rows, path = (call[f] for f in ("k", "n", "K", "codebook", "rows", "path"))
        t, dense = tensors_for(k, n, K)
        x = torch.randn(rows, k, generator=torch.Generator().manual_seed(i)).to(torch.float16).cuda()
        mcg, mul1 = flags[cb]
        if path == "linear_one":
            y = torch.ops.aphrodite.exl3_linear_one(x, t["trellis"], t["suh"], t["svh"], mcg, mul1)
        elif path in ("gemm_fp32", "forced"):
            y = torch.empty(rows, n, dtype=torch.float32 if path == "gemm_fp32" else torch.float16, device="cuda")
            shape_idx, sms = (
                kernels.forced_launch(cc, k, n, K, props.multi_processor_count) if path == "forced" else (-1, 0)
            )
            ops.exl3_gemm(x, t["trellis"], y, t["suh"], torch.empty_like(x), t["svh"], shape_idx, mcg, mul1, sms)
        elif path == "mgemm":
            t2, dense2 = tensors_for(k, n, K, seed=1)
            mats = (t, t2)
            ptrs = {
                name: torch.tensor([m[name].data_ptr() for m in mats], dtype=torch.long, device="cuda")
                for name in ("trellis", "suh", "svh")
            }
            c = torch.empty(2, rows, n, dtype=torch.float16, device="cuda")
            ops.exl3_mgemm(
                x.view(1, rows, k),
                ptrs["trellis"],
                c,
                ptrs["suh"],
                torch.empty(2, rows, k, dtype=torch.float16, device="cuda"),
                ptrs["svh"],
                None,
                None,
                K,
                -1,
                mcg,
                mul1,
                -1,
                -1,
                0,
            )
            second = decoded(c[1], dense2, x, cb)
            y = c[0]
        elif path == "layer":
            shard = {**t, **codec.marker_tensors(cb)}
            method = exl3.Exl3LinearMethod(exl3.Exl3Config(bits=float(K)))
            layer = exl3_linear_layer(exl3, method, f"model.layers.{i}.mlp.down_proj", {None: shard}, device="cuda")
            method.process_weights_after_loading(layer)
            y = method.apply(layer, x)
        else:
            raise ValueError(path)
        torch.cuda.synchronize()
        as_, err = decoded(y, dense, x, cb)
        entry = {"i": i, **call, "decoded_as": as_, "rel_err": err}
        if path == "mgemm":
            entry["second_matrix_decoded_as"] = second[0]
        if path == "layer":
            entry["routed"] = getattr(layer, "hxf_exl3_routes", {}).get(None)
        out.append(entry)
    verdicts = {
        str(k): {"codebook_blind": v.codebook_blind, "forced_ok": v.forced_ok, "detail": v.detail}
        for k, v in p13.VERDICTS.items()
    }
    print("RESULT " + json.dumps({"ok": True, "calls": out, "p3_probe": verdicts}), flush=True)


if __name__ == "__main__":
    main()
