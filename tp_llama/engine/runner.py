"""Each rank's side of a step: rank 0's plan sent to every rank, the batch built, the forward run."""

from __future__ import annotations

import torch
from torch import nn

from tp_llama.engine.decode_step import DecodeStep
from tp_llama.engine.plan import PlanWire, StepPlan
from tp_llama.model import Batch
from tp_llama.parallel.distributed import DistInfo, broadcast_from_rank0


class ModelRunner:
    def __init__(self, model: nn.Module, info: DistInfo, max_rows: int, max_tokens: int, max_blocks: int,
                 decode_step: DecodeStep | None = None):
        self.model, self.info, self.decode_step = model, info, decode_step
        self.cache = model.layers[0].attention.cache
        self.wire = PlanWire(max_rows, max_tokens, max_blocks)

    @torch.inference_mode()
    def run(self, plan: StepPlan | None = None) -> tuple[StepPlan, torch.Tensor | None]:
        """One step on this rank: rank 0 passes its plan, the others receive it.

        Returns the plan and the logits of its sampling rows (None for a plan without rows).
        """
        if self.info.world_size > 1:
            if self.info.rank == 0:
                broadcast_from_rank0(self.wire.encode(plan), self.info.device)
            else:
                plan = self.wire.decode(broadcast_from_rank0(torch.zeros(self.wire.size, dtype=torch.long),
                                                             self.info.device))
        if not plan.rows:
            return plan, None
        if self.decode_step is not None and self.decode_step.accepts(plan.rows):
            return plan, self.decode_step(plan.rows)
        rows = [(r.start, r.tokens, r.sample, r.blocks) for r in plan.rows]
        return plan, self.model(Batch.build(rows, self.cache.block_size, self.cache.spare, self.info.device))
