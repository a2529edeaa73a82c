# aphrodite 0.21.0 env_override._apply_constrain_to_fx_strides_patch, applied regardless of the torch version
import torch
import torch._inductor.ir as _ir
import torch._inductor.lowering as _lowering
from torch._inductor.virtualized import V as _V

print("original constrain_to_fx_strides:", _lowering.constrain_to_fx_strides)


def _patched(fx_node, *args, **kwargs):
    def apply_constraint(arg, fx_arg):
        if isinstance(arg, _ir.IRNode):
            meta_val = fx_arg.meta.get("val")
            if isinstance(meta_val, torch.Tensor):
                stride_order = _ir.get_stride_order(meta_val.stride(), _V.graph.sizevars.shape_env)
                return _ir.ExternKernel.require_stride_order(arg, stride_order)
            return arg
        if isinstance(arg, dict):
            return {key: apply_constraint(arg[key], fx_arg[key]) for key in arg}
        return arg

    args = tuple(apply_constraint(arg, fx_arg) for arg, fx_arg in zip(args, fx_node.args))
    kwargs = {k: apply_constraint(v, fx_node.kwargs[k]) for k, v in kwargs.items()}
    return args, kwargs


_lowering.constrain_to_fx_strides = _patched
