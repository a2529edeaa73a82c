"""Does a piece of a split graph return z with the strides the next piece was compiled for?
Pure torch on the CPU: aphrodite's pattern (two custom-op GEMM outputs, cat, cast, split, a
mutating splitting op, then the gated RMS norm), split like aphrodite's split_graph, each piece
compiled by Inductor's standalone_compile.

    PYTHONPATH=docs/upstream/repro python docs/upstream/repro/exl3_piecewise_strides.py [N] [--patch]

--patch first applies aphrodite 0.21.0's torch-2.11-only stride-order patch of Inductor's
constrain_to_fx_strides (aphrodite/env_override.py:463) whatever the torch version. Prints, per
compiled piece, the strides of what it returned against the strides traced for the next piece, any
input whose strides differ from those the piece was compiled for, and the compiled-vs-eager
difference. Result on torch 2.13 (CPU), with and without --patch: strides match, difference 0.0.
See docs/upstream/exl3-compiled-illegal-address.md."""
import sys
if "--patch" in sys.argv: import constrain_to_fx_strides_2_11  # noqa: F401
import torch
import torch.fx
from torch.fx.passes.split_module import split_module

Q, Z, H, D = 640, 384, 3, 128     # qkv 640 (=2*128+384), z = value_dim 384 = 3 heads x 128

@torch.library.custom_op("hxf::lin", mutates_args=())
def lin(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return (x.float() @ w.float()).half()

@lin.register_fake
def _(x, w):
    return x.new_empty((x.shape[0], w.shape[1]), dtype=torch.float16)

@torch.library.custom_op("hxf::core", mutates_args=["out"])
def core(qkv: torch.Tensor, out: torch.Tensor) -> None:
    out.copy_(qkv[:, Q - Z:].reshape(out.shape))

@core.register_fake
def _(qkv, out):
    return None

def f(h, wqkv, wz, nw, wo):
    x = h.to(torch.float16)
    y = torch.cat([lin(x, wqkv), lin(x, wz)], dim=-1).to(torch.bfloat16)
    qkv, z = y.split([Q, Z], dim=-1)
    z = z.reshape(z.size(0), -1, D)
    out = torch.zeros((h.shape[0], H, D), dtype=torch.bfloat16)
    torch.ops.hxf.core(qkv, out)
    zs = z.shape
    o, zz = out.reshape(-1, D).float(), z.reshape(-1, D).float()
    g = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + 1e-6) * nw.float() * torch.nn.functional.silu(zz)
    g = g.to(torch.bfloat16).reshape(zs).reshape(h.shape[0], H * D)
    return lin(g.to(torch.float16), wo).to(torch.bfloat16)

records = []

def backend(gm: torch.fx.GraphModule, example_inputs):
    ids, part = {}, 0
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        if node.op == "call_function" and node.target in (torch.ops.hxf.core, torch.ops.hxf.core.default):
            part += 1; ids[node] = part; part += 1
        else:
            ids[node] = part
    import inspect
    extra = {"tuple_return": True} if "tuple_return" in inspect.signature(split_module).parameters else {}
    split = split_module(gm, None, lambda n: ids[n], keep_original_order=True, **extra)
    for name, sub in list(split.named_children()):
        if any(n.op == "call_function" and n.target in (torch.ops.hxf.core, torch.ops.hxf.core.default) for n in sub.graph.nodes):
            continue
        ins = [n.meta["example_value"] if "example_value" in n.meta else n.meta.get("val")
               for n in sub.graph.nodes if n.op == "placeholder"]
        oargs = next(n for n in sub.graph.nodes if n.op == "output").args[0]
        oargs = [oargs] if isinstance(oargs, torch.fx.Node) else oargs
        outs = [a.meta.get("example_value", a.meta.get("val")) if hasattr(a, "meta") else None for a in oargs]
        compiled = torch._inductor.standalone_compile(sub, ins, dynamic_shapes="from_graph",
                                                      options={"config_patches": {"size_asserts": False}})
        def run(*args, _c=compiled, _n=name, _outs=outs, _ins=ins):
            for a, m in zip(args, _ins):
                if isinstance(a, torch.Tensor) and isinstance(m, torch.Tensor) and a.stride() != m.stride():
                    records.append(f"{_n} input: got stride {a.stride()} expected {m.stride()} (shape {tuple(a.shape)})")
            res = _c(*args)
            for r, m in zip(res if isinstance(res, (tuple, list)) else [res], _outs):
                if isinstance(r, torch.Tensor) and isinstance(m, torch.Tensor):
                    records.append(f"{_n} output: stride {r.stride()} traced {m.stride()} shape {tuple(r.shape)} "
                                   f"storage {r.untyped_storage().nbytes() // r.element_size()} elements")
            return res
        wrap = torch.nn.Module()
        wrap.forward = run
        delattr(split, name)
        setattr(split, name, wrap)
    return split

torch.manual_seed(0)
n = int(sys.argv[1]) if len(sys.argv) > 1 and sys.argv[1].isdigit() else 64
args = [torch.randn(n, 256), torch.randn(256, Q) / 16, torch.randn(256, Z) / 16, torch.ones(D), torch.randn(H * D, 256) / 16]
torch._dynamo.mark_dynamic(args[0], 0)
ref = f(*args)
got = torch.compile(f, backend=backend, fullgraph=True)(*args)
print("\n".join(records))
print("max |compiled - eager|:", (got.float() - ref.float()).abs().max().item())
