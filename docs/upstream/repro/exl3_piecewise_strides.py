"""Does a piece of a split graph return z with the strides the next piece was compiled for?
Pure torch on the CPU: aphrodite's pattern (two custom-op GEMM outputs, cat, [cast,] split, a
mutating splitting op, then the gated RMS norm), split like aphrodite's split_graph, each piece
compiled by Inductor's standalone_compile.

    python docs/upstream/repro/exl3_piecewise_strides.py [N] [--fp16] [--opaque-cat] [--patch]

--fp16: float16 activations, so no cast follows the cat (aphrodite's EXL3 apply casts back only
when the activations are not float16); the default is bfloat16, as in a bfloat16 checkpoint.
--opaque-cat: join the two GEMM outputs with a custom op instead of torch.cat (the overlay's P4).
--patch: first apply aphrodite 0.21.0's torch-2.11-only stride-order patch of Inductor's
constrain_to_fx_strides (aphrodite/env_override.py:463) whatever the torch version.

Prints, per compiled piece, the strides of what it returned against the strides traced for the
next piece, any input whose strides differ from those the piece was compiled for, and the
compiled-vs-eager difference. Result on torch 2.13 (CPU):
- bfloat16 (the cast between cat and split): strides match, difference 0.0;
- --fp16: the first piece returns z with row stride 384 (its own buffer) where 1024 (the cat's)
  was traced, the next piece reads past it: difference nan. Inductor's post-grad lowering pattern
  ``cat_splitwithsizes_replace`` rewrites split(cat([a, b])) to [a, b]; with
  ``pattern_matcher=False`` the strides match again;
- --fp16 --opaque-cat: strides match, difference 0.0.
On the H200 the same mismatch is the illegal memory access of docs/upstream/exl3-compiled-illegal-address.md.
The unit suite imports ``run`` (tests/unit/test_p4_fp16_cat.py)."""

from __future__ import annotations

import inspect
import sys

import torch
import torch.fx
from torch.fx.passes.split_module import split_module

Q, Z, H, D = 640, 384, 3, 128  # qkv 640 (=2*128+384), z = value_dim 384 = 3 heads x 128
_OPS: dict[str, object] = {}


def _ops():
    """The custom ops of the pattern, defined once per process."""
    if _OPS:
        return _OPS

    @torch.library.custom_op("hxf_repro::lin", mutates_args=())
    def lin(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return (x.float() @ w.float()).half()

    @lin.register_fake
    def _(x, w):
        return x.new_empty((x.shape[0], w.shape[1]), dtype=torch.float16)

    @torch.library.custom_op("hxf_repro::core", mutates_args=["out"])
    def core(qkv: torch.Tensor, out: torch.Tensor) -> None:
        out.copy_(qkv[:, Q - Z :].reshape(out.shape))

    @core.register_fake
    def _(qkv, out):
        return None

    @torch.library.custom_op("hxf_repro::cat", mutates_args=())
    def cat(tensors: list[torch.Tensor]) -> torch.Tensor:
        return torch.cat(tensors, dim=-1)

    @cat.register_fake
    def _(tensors):
        return tensors[0].new_empty((*tensors[0].shape[:-1], sum(t.shape[-1] for t in tensors)))

    _OPS.update(lin=lin, core=torch.ops.hxf_repro.core, cat=cat)
    return _OPS


def model(dtype: torch.dtype, join):
    lin, core = _ops()["lin"], _ops()["core"]

    def f(h, wqkv, wz, nw, wo):
        x = h.to(torch.float16)
        y = join([lin(x, wqkv), lin(x, wz)])
        y = y.to(dtype)  # a no-op for float16: then the split follows the cat directly
        qkv, z = y.split([Q, Z], dim=-1)
        z = z.reshape(z.size(0), -1, D)
        out = torch.zeros((h.shape[0], H, D), dtype=dtype)
        core(qkv, out)
        zs = z.shape
        o, zz = out.reshape(-1, D).float(), z.reshape(-1, D).float()
        g = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + 1e-6) * nw.float() * torch.nn.functional.silu(zz)
        g = g.to(dtype).reshape(zs).reshape(h.shape[0], H * D)
        return lin(g.to(torch.float16), wo).to(dtype)

    return f


def piecewise_backend(records: list[str], config_patches: dict):
    """Split the graph at the mutating op as aphrodite's split_graph does; compile every other piece
    alone with Inductor; record each piece's input and output strides against the traced ones."""
    core = _ops()["core"]
    targets = (core, core.default)

    def backend(gm: torch.fx.GraphModule, example_inputs):
        ids, part = {}, 0
        for node in gm.graph.nodes:
            if node.op in ("placeholder", "output"):
                continue
            if node.op == "call_function" and node.target in targets:
                part += 1
                ids[node] = part
                part += 1
            else:
                ids[node] = part
        extra = {"tuple_return": True} if "tuple_return" in inspect.signature(split_module).parameters else {}
        split = split_module(gm, None, lambda n: ids[n], keep_original_order=True, **extra)
        for name, sub in list(split.named_children()):
            if any(n.op == "call_function" and n.target in targets for n in sub.graph.nodes):
                continue
            ins = [
                n.meta["example_value"] if "example_value" in n.meta else n.meta.get("val")
                for n in sub.graph.nodes
                if n.op == "placeholder"
            ]
            oargs = next(n for n in sub.graph.nodes if n.op == "output").args[0]
            oargs = [oargs] if isinstance(oargs, torch.fx.Node) else oargs
            outs = [a.meta.get("example_value", a.meta.get("val")) if hasattr(a, "meta") else None for a in oargs]
            compiled = torch._inductor.standalone_compile(
                sub,
                ins,
                dynamic_shapes="from_graph",
                options={"config_patches": {"size_asserts": False, **config_patches}},
            )

            def run(*args, _c=compiled, _n=name, _outs=outs, _ins=ins):
                for a, m in zip(args, _ins):
                    if isinstance(a, torch.Tensor) and isinstance(m, torch.Tensor) and a.stride() != m.stride():
                        records.append(
                            f"{_n} input: got stride {a.stride()} expected {m.stride()} (shape {tuple(a.shape)})"
                        )
                res = _c(*args)
                for r, m in zip(res if isinstance(res, (tuple, list)) else [res], _outs):
                    if isinstance(r, torch.Tensor) and isinstance(m, torch.Tensor):
                        records.append(f"{_n} output: stride {r.stride()} traced {m.stride()} shape {tuple(r.shape)}")
                return res

            wrap = torch.nn.Module()
            wrap.forward = run
            delattr(split, name)
            setattr(split, name, wrap)
        return split

    return backend


def run(
    n: int = 64, fp16: bool = False, opaque_cat: bool = False, config_patches: dict | None = None, join=None
) -> dict:
    """Compile and run the pattern once; returns {"records": [...], "mismatches": [...], "max_abs_diff": float}.
    ``join``: what joins the two GEMM outputs (default torch.cat, or this script's custom op with ``opaque_cat``)."""
    torch._dynamo.reset()
    dtype = torch.float16 if fp16 else torch.bfloat16
    join = join or (_ops()["cat"] if opaque_cat else (lambda ts: torch.cat(ts, dim=-1)))
    f = model(dtype, join)
    gen = torch.Generator().manual_seed(0)
    args = [
        torch.randn(n, 256, generator=gen),
        torch.randn(256, Q, generator=gen) / 16,
        torch.randn(256, Z, generator=gen) / 16,
        torch.ones(D),
        torch.randn(H * D, 256, generator=gen) / 16,
    ]
    torch._dynamo.mark_dynamic(args[0], 0)
    ref = f(*args)
    records: list[str] = []
    got = torch.compile(f, backend=piecewise_backend(records, config_patches or {}), fullgraph=True)(*args)
    return {
        "records": records,
        "mismatches": [r for r in records if "got stride" in r],
        "max_abs_diff": (got.float() - ref.float()).abs().max().item(),
    }


if __name__ == "__main__":
    if "--patch" in sys.argv:
        sys.path.insert(0, __file__.rsplit("/", 1)[0])
        import constrain_to_fx_strides_2_11  # noqa: F401
    size = next((int(a) for a in sys.argv[1:] if a.isdigit()), 64)
    result = run(size, fp16="--fp16" in sys.argv, opaque_cat="--opaque-cat" in sys.argv)
    print("\n".join(result["records"]))
    print("max |compiled - eager|:", result["max_abs_diff"])
