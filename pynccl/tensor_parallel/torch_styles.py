"""torch.distributed.tensor.parallel's ParallelStyle objects in a pynccl plan, mapped field by field
onto pynccl's styles (styles.py), which have the same fields and the same meaning on plain tensors:

    torch ColwiseParallel / RowwiseParallel   input_layouts[0], output_layouts[0], use_local_output
    torch SequenceParallel                    sequence_sharding[0].dim -> sequence_dim, use_local_output
    torch PrepareModuleInput                  input_layouts, desired_input_layouts, the kwarg ones
    torch PrepareModuleOutput                 output_layouts, desired_output_layouts
    torch PrepareModuleInputOutput            the two above, applied in that order

pynccl has no DTensor: every style's outputs are plain local tensors, what torch's
use_local_output=True gives. So ColwiseParallel / RowwiseParallel / PrepareModuleOutput with
use_local_output=False (a DTensor of the global shape under torch) raise ValueError naming it.
SequenceParallel's and PrepareModuleInput's default False is taken, their tensors local (the DTensor
would only carry them to the next style); PrepareModuleInput's True keeps torch's gradient
semantics (relayout.py). Any other torch style is refused with a TypeError naming it.
"""
from __future__ import annotations

import sys
from typing import Tuple


def is_torch_style(style) -> bool:
    """Whether `style` is a torch ParallelStyle (looked up only if torch's module is loaded: a torch
    style cannot exist otherwise, so this costs no import)."""
    module = sys.modules.get("torch.distributed.tensor.parallel.style")
    return module is not None and isinstance(style, module.ParallelStyle)


def from_torch_style(style, where: str) -> Tuple:
    """pynccl's style(s) for torch style `style` (plan key `where`, for errors)."""
    from torch.distributed.tensor import parallel as tp

    from . import relayout, styles
    if isinstance(style, (tp.ColwiseParallel, tp.RowwiseParallel)):
        mine = styles.ColwiseParallel if isinstance(style, tp.ColwiseParallel) else styles.RowwiseParallel
        return (mine(input_layouts=style.input_layouts[0], output_layouts=style.output_layouts[0],
                     use_local_output=style.use_local_output),)
    if isinstance(style, tp.SequenceParallel):
        return (styles.SequenceParallel(sequence_dim=style.sequence_sharding[0].dim,
                                        use_local_output=style.use_local_output),)
    if isinstance(style, tp.PrepareModuleInput):
        return (relayout.PrepareModuleInput(input_layouts=style.input_layouts,
                                            desired_input_layouts=style.desired_input_layouts,
                                            input_kwarg_layouts=style.input_kwarg_layouts or None,
                                            desired_input_kwarg_layouts=style.desired_input_kwarg_layouts or None,
                                            use_local_output=style.use_local_output),)
    if isinstance(style, tp.PrepareModuleOutput):
        return (relayout.PrepareModuleOutput(output_layouts=style.output_layouts,
                                             desired_output_layouts=style.desired_output_layouts,
                                             use_local_output=style.use_local_output),)
    if type(style).__name__ == "PrepareModuleInputOutput":
        return (from_torch_style(style.prepare_module_input, where)[0],
                from_torch_style(style.prepare_module_output, where)[0])
    raise TypeError(f"parallelize_module: plan[{where!r}] is torch's {type(style).__name__}, which pynccl does not "
                    f"map; use ColwiseParallel, RowwiseParallel, SequenceParallel, PrepareModuleInput or "
                    f"PrepareModuleOutput (torch's or pynccl.tensor_parallel's)")
