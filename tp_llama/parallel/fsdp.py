"""The `fsdp` mode's wrapping: FSDP1 over a device mesh, one unit per block.

torch.distributed's FSDP and DTensor packages (and with them torch._dynamo) are imported only
when called, so that the `tp` mode's start-up stays light.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from tp_llama.model import Transformer, TransformerBlock

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP


def make_mesh(device: torch.device, world_size: int) -> DeviceMesh:
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device.type, (world_size,))


def apply_fsdp(model: Transformer, mesh: DeviceMesh, device: torch.device) -> FSDP:
    """FSDP1 with one unit per block; built over the mesh so it takes DTensor state dicts too."""
    from torch.distributed.fsdp import FullyShardedDataParallel
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    return FullyShardedDataParallel(
        model,
        device_mesh=mesh,
        auto_wrap_policy=ModuleWrapPolicy({TransformerBlock}),
        device_id=device,
        param_init_fn=lambda m: m.to_empty(device=device, recurse=False),
        use_orig_params=True,
    )
