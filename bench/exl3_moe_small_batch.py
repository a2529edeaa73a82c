"""P16 per kernel: one EXL3 MoE layer of the Qwen3.6-35B-A3B's shape (256 experts, 8 a token, hidden 2048, experts
512 wide, 3 bits, mcg as make-tiny and exllamav3 write them) at 1 - 32 tokens, on each candidate path, beside the
memory roofline of the distinct experts the tokens read.

    python3 bench/exl3_moe_small_batch.py --out DIR          # on the GPU machine, aphrodite importable
    python3 bench/exl3_moe_small_batch.py --report DIR/exl3_moe_small_batch.json --out bench/results   # anywhere

The layer is aphrodite's own: random EXL3 experts set up by the release's ``Exl3MoEMethod._setup_fused_moe_kernel`` and
called through the release's ``Exl3MoEMethod.apply`` (float16 input, top-k ids and weights as the router gives them).
Paths:
  ``loop``     the release as shipped: ``_apply_small_batch``'s loop over the tokens (one token:
               ``_apply_single_token``)
  ``grouped``  the release's grouped ``ops.exl3_moe`` path, reached with ``exl3_small_batch_threshold = 1``
  ``P16``      P16's ``_apply_small_batch``: every token's experts through one ``exl3_mgemm`` per projection
Each path is captured in a CUDA graph per token count (as the engine's decode runs) and timed by replays (CUDA events,
rounds of replays, the paths interleaved, median and spread of the rounds). Correctness: each path's output against the
loop's, eager and replayed after new routing is copied into the graph's inputs, at every token count 2 - 32.
Routing: each token's 8 experts drawn uniformly without replacement (a real router is skewed, so it shares more
experts between tokens than this). The roofline: the bytes of the distinct experts the batch routes to (trellis,
suh and svh of gate, up and down), at the copy bandwidth measured on the same GPU first.
"""

from __future__ import annotations

import argparse
import inspect
import json
import sys
import time
import types
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

ROWS = (1, 2, 4, 8, 16, 32)
CHECK_ROWS = tuple(range(2, 33))
PATHS = ("loop", "grouped", "P16")


def PROJECTIONS(hidden: int, inter: int):  # noqa: N802 - a table
    return (("w13", "w1", (hidden, inter)), ("w13", "w3", (hidden, inter)), ("w2", "w2", (inter, hidden)))


def build_layer(experts: int, top_k: int, hidden: int, inter: int, bits: int, seed: int = 0):
    """Random EXL3 experts in the attributes aphrodite's MoE method reads, set up by the release's own code."""
    import torch
    from aphrodite.model_executor.layers.fused_moe.activation import MoEActivation
    from aphrodite.model_executor.layers.quantization import exl3

    from hybrid_exl3_fixes.checkpoint import codec

    device = torch.device("cuda", torch.cuda.current_device())
    gen = torch.Generator(device=device).manual_seed(seed)
    root = codec.sign_scale("mcg")

    def linear(k, n):
        trellis = torch.randint(-(1 << 15), 1 << 15, (k // 16, n // 16, 16 * bits), generator=gen, device=device)
        signs = [(torch.randint(0, 2, (d,), generator=gen, device=device) * 2 - 1) * root for d in (k, n)]
        return trellis.to(torch.int16), signs[0].half(), signs[1].half()

    tensors = {p: {a: {} for a in ("trellis", "suh", "svh", "mcg", "mul1")} for p in ("w13", "w2")}
    marker = codec.marker_tensors("mcg")["mcg"].to(device)
    for e in range(experts):
        for prefix, shard, (k, n) in (
            ("w13", "w1", (hidden, inter)),
            ("w13", "w3", (hidden, inter)),
            ("w2", "w2", (inter, hidden)),
        ):
            t, suh, svh = linear(k, n)
            for attr, value in (("trellis", t), ("suh", suh), ("svh", svh), ("mcg", marker)):
                tensors[prefix][attr][(e, shard)] = value
    layer = types.SimpleNamespace(
        activation=MoEActivation.SILU,
        expert_map=None,
        apply_router_weight_on_input=False,
        local_num_experts=experts,
        top_k=top_k,
        hidden_size=hidden,
        exl3_intermediate_size_per_partition=inter,
        **{
            f"{prefix}_{attr}": types.SimpleNamespace(exl3_tensors=d)
            for prefix, attrs in tensors.items()
            for attr, d in attrs.items()
        },
    )
    exl3.Exl3MoEMethod._setup_fused_moe_kernel(layer, device)
    return layer


def routing(rows: int, experts: int, top_k: int, gen):
    import torch

    ids = torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(rows)])
    weights = torch.softmax(torch.randn(rows, top_k, generator=gen), -1)
    return ids.cuda(), weights.half().cuda()


def distinct_bytes(layer, ids) -> int:
    """Bytes of the distinct experts ``ids`` routes to: trellis, suh and svh of gate, up and down."""
    per_expert = sum(
        t.numel() * t.element_size()
        for prefix, shards in (("w13", ("w1", "w3")), ("w2", ("w2",)))
        for shard in shards
        for attr in ("trellis", "suh", "svh")
        for t in [getattr(layer, f"{prefix}_{attr}").exl3_tensors[(0, shard)]]
    )
    return int(ids.unique().numel()) * per_expert


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--report", type=Path, help="only write the tables of an existing JSON")
    parser.add_argument("--experts", type=int, default=256)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--intermediate", type=int, default=512)
    parser.add_argument("--bits", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--replays", type=int, default=50)
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.report:
        data = json.loads(args.report.read_text())
    else:
        data = measure(args)
        (args.out / "exl3_moe_small_batch.json").write_text(json.dumps(data, indent=1))
    (args.out / "exl3_moe_small_batch.md").write_text(report(data))
    print(report(data))
    return 0


def measure(args) -> dict:
    import torch
    from aphrodite.model_executor.layers.quantization import exl3
    from roofline import measure_bandwidth

    from hybrid_exl3_fixes.aphrodite.model_executor.layers.quantization.exl3 import p16_moe_small_batch as p16

    bandwidth = measure_bandwidth() * 1e9  # bytes/s (it answers GB/s), before the layer holds the GPU's memory
    t0 = time.time()
    layer = build_layer(args.experts, args.top_k, args.hidden, args.intermediate, args.bits)
    setup_s = time.time() - t0
    cls = exl3.Exl3MoEMethod
    method = cls.__new__(cls)
    original = vars(cls)["_apply_small_batch"]
    if getattr(original, "__hybrid_exl3_fixes_patch__", None):
        original = original.__wrapped__
    patched = p16.build_moe_small_batch({p16.MOE_SMALL_BATCH.key: types.SimpleNamespace(function=original)})[
        p16.MOE_SMALL_BATCH.key
    ]
    threshold = layer.exl3_small_batch_threshold
    # 0.20 / 0.21: apply(layer, x, topk_weights, topk_ids, shared_experts_input); 0.22+ add shared_experts before it
    extra = (None,) * (len(inspect.signature(cls.apply).parameters) - 5)
    gen = torch.Generator().manual_seed(1)

    def run(path, x, ids, weights):
        layer.exl3_small_batch_threshold = 1 if path == "grouped" else threshold
        cls._apply_small_batch = patched if path == "P16" else original
        try:
            return method.apply(layer, x, weights, ids, *extra)
        finally:
            cls._apply_small_batch = original
            layer.exl3_small_batch_threshold = threshold

    checks, times, graphs = {}, {}, {}
    for rows in sorted(set(ROWS) | set(CHECK_ROWS)):
        x = (torch.randn(rows, args.hidden, generator=gen) * 0.5).to(torch.bfloat16).cuda()
        ids, weights = routing(rows, args.experts, args.top_k, gen)
        reference = run("loop", x, ids, weights).float()
        for path in PATHS:
            eager = run(path, x, ids, weights).float()
            statics = (x.clone(), ids.clone(), weights.clone())
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                run(path, *statics)  # warm on the side stream, as torch's graph capture asks
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out = run(path, *statics)
            x2 = (torch.randn(rows, args.hidden, generator=gen) * 0.5).to(torch.bfloat16).cuda()
            ids2, weights2 = routing(rows, args.experts, args.top_k, gen)
            for s, new in zip(statics, (x2, ids2, weights2)):
                s.copy_(new)
            graph.replay()
            replayed = out.float().clone()
            reference2 = run("loop", x2, ids2, weights2).float()
            checks[f"{path}/{rows}"] = {
                "eager": rel(eager, reference),
                "graph": rel(replayed, reference2),
            }
            if rows in ROWS:
                graphs[(path, rows)] = graph
                times[f"{path}/{rows}"] = []
            else:
                del graph
        if rows in ROWS:
            times[f"bytes/{rows}"] = distinct_bytes(layer, ids)
    for _ in range(args.rounds):
        for rows in ROWS:
            for path in PATHS:
                graph = graphs[(path, rows)]
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                graph.replay()
                start.record()
                for _ in range(args.replays):
                    graph.replay()
                end.record()
                end.synchronize()
                times[f"{path}/{rows}"].append(start.elapsed_time(end) * 1e3 / args.replays)
    props = torch.cuda.get_device_properties(0)
    import aphrodite

    return {
        "device": props.name,
        "aphrodite": aphrodite.__version__,
        "torch": torch.__version__,
        "shape": {
            "experts": args.experts,
            "top_k": args.top_k,
            "hidden": args.hidden,
            "intermediate": args.intermediate,
            "bits": args.bits,
            "codebook": "mcg",
            "fused_gate_up": bool(layer.exl3_fuse_gate_up),
            "small_batch_threshold": threshold,
        },
        "bandwidth_bytes_s": bandwidth,
        "setup_s": setup_s,
        "rounds": args.rounds,
        "replays": args.replays,
        "rows": list(ROWS),
        "paths": list(PATHS),
        "times_us": times,
        "checks": checks,
        "p16_call_bytes": p16.call_bytes(threshold, args.top_k, args.hidden, args.intermediate),
    }


def rel(y, reference) -> float:
    return float((y - reference).norm() / reference.norm().clamp_min(1e-30))


def median(values):
    s = sorted(values)
    return s[len(s) // 2]


def report(data: dict) -> str:
    shape = data["shape"]
    times = data["times_us"]
    lines = [
        f"# One EXL3 MoE layer at 1 - 32 tokens ({data['device']}, aphrodite {data['aphrodite']})",
        "",
        f"{shape['experts']} experts, {shape['top_k']} a token, hidden {shape['hidden']}, experts "
        f"{shape['intermediate']} wide, {shape['bits']} bits ({shape['codebook']}; gate and up fused: "
        f"{shape['fused_gate_up']}); the release's small-batch threshold {shape['small_batch_threshold']}. Each path "
        f"captured in a CUDA graph per token count, {data['rounds']} rounds of {data['replays']} replays, paths "
        "interleaved: median us a layer (min-max of the rounds). Roofline: the distinct experts' bytes at "
        f"{data['bandwidth_bytes_s'] / 1e9:.0f} GB/s (measured copy "
        "bandwidth). Written by bench/exl3_moe_small_batch.py.",
        "",
        "| tokens | loop (release) | grouped exl3_moe | P16 | roofline | loop / P16 | grouped / P16 "
        "| P16 of roofline |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for rows in data["rows"]:
        med = {p: median(times[f"{p}/{rows}"]) for p in data["paths"]}
        span = {p: f"{min(times[f'{p}/{rows}']):.1f}-{max(times[f'{p}/{rows}']):.1f}" for p in data["paths"]}
        roof = times[f"bytes/{rows}"] / data["bandwidth_bytes_s"] * 1e6
        cells = [f"{med[p]:.1f} ({span[p]})" for p in data["paths"]]
        lines.append(
            f"| {rows} | {' | '.join(cells)} | {roof:.1f} | {med['loop'] / med['P16']:.2f} | "
            f"{med['grouped'] / med['P16']:.2f} | {roof / med['P16']:.0%} |"
        )
    worst = {
        p: max(max(v["eager"], v["graph"]) for k, v in data["checks"].items() if k.startswith(p + "/"))
        for p in data["paths"]
    }
    lines += [
        "",
        "Largest relative error against the release's loop at 2 - 32 tokens (eager, and a graph replayed on new "
        "routing): "
        + ", ".join(f"{p} {worst[p]:.2e}" for p in data["paths"])
        + f". What one P16 call allocates at {data['shape']['small_batch_threshold']} tokens: "
        f"{data['p16_call_bytes'] / 2**20:.2f} MiB (freed after the layer).",
    ]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
