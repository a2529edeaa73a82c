"""P8 per kernel: every EXL3 projection of one Qwen3.6-27B decode step at 1, 8, 16 and 32 rows, aphrodite's launch
against the launches P8 measures and the one it picks, on the GPU; and the step time those sum to.

    python3 bench/exl3_kernel_choice.py --out DIR          # on the GPU machine, aphrodite 0.20 - 0.23 importable
    python3 bench/exl3_kernel_choice.py --report DIR/exl3_kernel_choice.json --out bench/results   # anywhere

Paths, each on random EXL3 weights of the layer's shape and bits (``random_layer``; decoded as mcg, as make-tiny and
exllamav3 write them):
  single projections (``exl3_gemm`` at <= 32 rows; GDN in_proj_qkv, in_proj_z, out_proj, o_proj, down_proj, the
  6-bit head; q of the attention's q/k/v, which runs inside aphrodite's ``exl3_qkv`` op and P8 leaves alone):
  ``native`` aphrodite's table launch, ``heuristic`` exllamav3's shape heuristic (P3's uncached launch), ``p8`` the
  launch P8 picks from these same times (overlay/decisions/p8_kernel_choice.py: 3 % margin), ``best`` the fastest
  launch timed;
  fused pairs (``exl3_mgemm``: gate/up, k/v): ``native`` aphrodite's call (exllamav3's heuristic, no table) against
  every forced shape and SM count. Times: P8's own measurement (``p8_kernel_choice.measure_launches``: CUDA
  events, ROUNDS rounds of CALLS calls, launches interleaved, median), with more rounds. A forced launch whose
  output differs from the reconstruct path's (relative error >= 2e-2) is not timed, so never picked.
The step sum: 48 GDN layers (in_proj_qkv, in_proj_z, gate/up, out_proj, down) and 16 attention layers (q, k/v,
o_proj, gate/up, down) and the head, per row count, native against P8's picks (the GEMMs only: the step also runs
attention, the GDN recurrence, norms and sampling).
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

HIDDEN, INTER, HEAD_VOCAB = 5120, 17408, 248320
# (name, k, n, bits, layers using it per step, path): the 27B's projections (overlay/checkpoint/stream.py's preset)
PROJECTIONS = [
    ("gdn in_proj_qkv", HIDDEN, 10240, 3, 48, "gemm"),
    ("gdn in_proj_z", HIDDEN, 6144, 3, 48, "gemm"),
    ("gdn out_proj / attn o_proj", 6144, HIDDEN, 3, 64, "gemm"),
    ("mlp down_proj", INTER, HIDDEN, 3, 64, "gemm"),
    ("attn q (inside exl3_qkv)", HIDDEN, 12288, 3, 16, "gemm-native-only"),
    ("head", HIDDEN, HEAD_VOCAB, 6, 1, "gemm"),
    ("mlp gate/up (exl3_mgemm x2)", HIDDEN, INTER, 3, 64, "mgemm"),
    ("attn k/v (exl3_mgemm x2)", HIDDEN, 1024, 3, 16, "mgemm"),
]


def random_layer(k, n, K, gen, dev, torch, codec) -> dict:
    """Random EXL3 tensors of a ``k x n`` layer at ``K`` bits, made on the GPU: any 16-bit words are a valid
    trellis (a stream of K-bit symbols), and the signs are scaled as make-tiny's (``codec.sign_scale``). Made
    directly, not through ``codec.random_exl3_linear``, whose int64 symbols of the 6-bit head alone take 10 GB of
    host memory."""
    trellis = torch.randint(-(1 << 15), 1 << 15, (k // 16, n // 16, 16 * K), generator=gen, dtype=torch.int32)
    root = codec.sign_scale("mcg", 0.02)
    signs = [(torch.randint(0, 2, (size,), generator=gen) * 2 - 1) * root for size in (k, n)]
    return {
        "trellis": trellis.to(torch.int16).to(dev),
        "suh": signs[0].to(torch.float16).to(dev),
        "svh": signs[1].to(torch.float16).to(dev),
    }


def measure(out: Path, rounds: int, only: list[str]) -> None:
    import torch

    from hybrid_exl3_fixes.aphrodite.model_executor.layers.quantization.exl3 import p8_kernel_choice as p8
    from hybrid_exl3_fixes.checkpoint import codec
    from hybrid_exl3_fixes.decisions import exl3_kernels as kernels
    from hybrid_exl3_fixes.decisions import p8_kernel_choice as choice

    p8.ROUNDS = rounds
    dev = torch.device("cuda:0")
    props = torch.cuda.get_device_properties(0)
    cc, sms = kernels.compute_class(props.major, props.minor), props.multi_processor_count
    gen = torch.Generator().manual_seed(0)
    report = {"device": f"{props.name}, {sms} SMs, class {cc}", "rounds": rounds, "calls": p8.CALLS, "rows": []}
    import aphrodite

    report["aphrodite"] = aphrodite.__version__
    for name, k, n, K, count, path in PROJECTIONS:
        t0 = time.perf_counter()
        if only and not any(name.startswith(o) for o in only):
            continue
        mats = [random_layer(k, n, K, gen, dev, torch, codec) for _ in range(2 if path == "mgemm" else 1)]
        launches = choice.candidates(cc, k, n, K, sms)
        if path == "mgemm":
            times = mgemm_times(mats, K, launches, torch, p8, choice, kernels)
            picked = None
        else:
            m = mats[0]
            times = p8.measure_launches(
                m["trellis"], m["suh"], m["svh"], "mcg", [] if path.endswith("only") else launches
            )
            picked = choice.decide(times) if not path.endswith("only") else None
        for rows, at in times.items():
            native = at.get((choice.NATIVE, 0))
            forced = {f"{s}/{m}": t for (s, m), t in at.items() if s != choice.NATIVE}
            row = {"name": name, "k": k, "n": n, "K": K, "count": count, "path": path, "rows": rows, "native": native}
            if forced:
                best = min(forced, key=forced.get)
                row |= {"best": forced[best], "best_launch": best}
                heur = f"{launches[0][0]}/{launches[0][1]}" if launches else None
                row |= {"heuristic": forced.get(heur), "heuristic_launch": heur}
            if picked is not None:
                s, m = choice.launch_for(picked, rows)
                row |= {"p8": at.get((s, m)), "p8_launch": "native" if s == choice.NATIVE else f"{s}/{m}"}
            row["timed"] = {("native" if s == choice.NATIVE else f"{s}/{m}"): t for (s, m), t in at.items()}
            report["rows"].append(row)
        print(f"{name}: {time.perf_counter() - t0:.1f} s; " + "; ".join(describe(r) for r in report["rows"][-4:]))
        out.mkdir(parents=True, exist_ok=True)
        (out / "exl3_kernel_choice.json").write_text(json.dumps(report, indent=1))
        del mats
        torch.cuda.empty_cache()


def mgemm_times(mats, K, launches, torch, p8, choice, kernels):
    """exl3_mgemm over the two matrices as aphrodite's exl3_gate_up calls it (force -1, 0) and with every forced
    launch (its SM count is mgemm's own limit per matrix); outputs checked against the reconstruct path."""
    from aphrodite import _custom_ops as ops

    dev = mats[0]["trellis"].device
    k, n = mats[0]["trellis"].shape[0] * 16, mats[0]["trellis"].shape[1] * 16
    ptr = {
        a: torch.tensor([m[a].data_ptr() for m in mats], dtype=torch.long, device=dev)
        for a in ("trellis", "suh", "svh")
    }
    linear = torch.ops.aphrodite.exl3_linear_one
    g = torch.Generator(device=dev).manual_seed(0)
    x_all = torch.randn(kernels.SMALL_BATCH_ROWS + 1, k, generator=g, device=dev).to(torch.float16)
    refs = [linear(x_all, m["trellis"], m["suh"], m["svh"], True, False).float() for m in mats]
    times = {}
    for rows in choice.ROW_STEPS:
        x = x_all[:rows].contiguous().view(1, rows, k)
        out = torch.empty((2, rows, n), device=dev, dtype=torch.float16)
        x_had = torch.empty((2, rows, k), device=dev, dtype=torch.float16)

        def call(s=-1, m=0):
            ops.exl3_mgemm(
                x, ptr["trellis"], out, ptr["suh"], x_had, ptr["svh"], None, None, K, s, True, False, -1, -1, m
            )
            return out

        fns = {(choice.NATIVE, 0): call}
        for s, m in launches:
            got = call(s, m).float()
            err = max(float((got[i] - refs[i][:rows]).norm() / refs[i][:rows].norm()) for i in range(2))
            if err < kernels.SAME:
                fns[(s, m)] = lambda s=s, m=m: call(s, m)
        times[rows] = p8._time(fns, torch)
    return times


def describe(r) -> str:
    text = f"{r['rows']}r native {r['native']:.1f}"
    if "p8" in r:
        text += f" p8 {r['p8']:.1f} ({r['p8_launch']})"
    if "best" in r:
        text += f" best {r['best']:.1f} ({r['best_launch']})"
    return text


# -- the report (no GPU) --------------------------------------------------------------------------


def step_sums(rows: list[dict]) -> dict[int, dict[str, float]]:
    """Per row count, the GEMMs of one step summed (µs): aphrodite's launches and P8's picks (the fused pairs and q
    keep aphrodite's launch in both)."""
    sums: dict[int, dict[str, float]] = {}
    for r in rows:
        at = sums.setdefault(r["rows"], {"native": 0.0, "p8": 0.0})
        at["native"] += r["count"] * r["native"]
        at["p8"] += r["count"] * r.get("p8", r["native"])
    return sums


def md_table(head: list[str], rows: list[list]) -> list[str]:
    return ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)] + [
        "| " + " | ".join(str(c) for c in row) + " |" for row in rows
    ]


def render(report: dict, out: Path, stem: str = "exl3_kernel_choice") -> str:
    rows = report["rows"]
    fields = [
        "name",
        "k",
        "n",
        "K",
        "rows",
        "native",
        "heuristic",
        "heuristic_launch",
        "p8",
        "p8_launch",
        "best",
        "best_launch",
    ]
    out.mkdir(parents=True, exist_ok=True)
    with open(out / f"{stem}.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields + ["count"], extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)

    def us(v):
        return "" if v is None else f"{v:.1f}"

    table = [
        [
            r["name"],
            f"{r['k']} x {r['n']}",
            r["K"],
            r["rows"],
            us(r["native"]),
            f"{us(r.get('heuristic'))} ({r.get('heuristic_launch', '')})" if r.get("heuristic") else "",
            f"{us(r['p8'])} ({r['p8_launch']})" if "p8" in r else "aphrodite's op",
            f"{us(r.get('best'))} ({r.get('best_launch', '')})" if r.get("best") else "",
            f"{r['p8'] / r['native']:.2f}" if "p8" in r and r["native"] else "",
        ]
        for r in rows
    ]
    sums = step_sums(rows)
    lines = [
        f"# P8 per kernel: the Qwen3.6-27B's EXL3 projections ({report['device']}; aphrodite-engine "
        f"{report['aphrodite']}; µs, median of {report['rounds']} rounds of {report['calls']} calls)",
        "",
        "Random EXL3 weights (mcg) of each projection's shape and bits; times from P8's own measurement with more "
        "rounds (bench/exl3_kernel_choice.py). `native`: aphrodite's launch; `heuristic`: exllamav3's shape "
        "heuristic, one block per tile up to one per SM (P3's uncached launch); `P8`: the launch P8 picks from these "
        "times (3 % margin); `best`: the fastest launch timed. Launches as shape/SMs. The fused pairs run "
        "`exl3_mgemm` (aphrodite's `exl3_gate_up` / `exl3_qkv` ops), which P8 leaves alone.",
        "",
    ]
    lines += md_table(
        ["projection", "k x n", "bits", "rows", "native", "heuristic", "P8", "best", "P8 / native"], table
    )
    lines += ["", "The GEMMs of one decode step summed (48 GDN + 16 attention layers and the head):", ""]
    lines += md_table(
        ["rows", "native µs", "with P8 µs", "saved µs", "saved"],
        [
            [
                n,
                f"{s['native']:.0f}",
                f"{s['p8']:.0f}",
                f"{s['native'] - s['p8']:.0f}",
                f"{1 - s['p8'] / s['native']:.1%}",
            ]
            for n, s in sorted(sums.items())
        ],
    )
    text = "\n".join(lines) + "\n"
    (out / f"{stem}.md").write_text(text)
    return text


def bench_main(doc: str, name: str, measure, render, rounds: int) -> None:
    """The command line this bench and bench/exl3_mid_batch.py share: measure on the GPU into --out, or render a
    measurement's JSON (--report) anywhere; a file that cannot be read is a message, not a traceback."""
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    ap.add_argument("--out", default="out")
    ap.add_argument("--rounds", type=int, default=rounds)
    ap.add_argument("--only", default="", help="comma list: measure the projections whose names start so")
    ap.add_argument("--report", type=Path, help="render this measurement's JSON into OUT (no GPU)")
    args = ap.parse_args()
    if args.report is not None:
        try:
            print(render(json.loads(args.report.read_text()), Path(args.out)))
        except (OSError, ValueError, KeyError, TypeError) as exc:
            sys.exit(f"{name}: cannot read {args.report}: {exc}")
        return
    measure(Path(args.out), args.rounds, [o for o in args.only.split(",") if o])


def main() -> None:
    bench_main(__doc__, "exl3_kernel_choice", measure, render, 15)


if __name__ == "__main__":
    main()
