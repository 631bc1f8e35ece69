"""Pipeline parallelism on ``torch.distributed.pipelining``: the engine
(:mod:`.engine`: :class:`PipelineModule`, :class:`PipelineEngine`), torch's schedules by name
(:mod:`.schedules`), a stage's blocks as one module and Lightning steps for any strategy
(:mod:`.steps`), the stage plan of a module (:mod:`.stages`), stage boundaries between ranks
packed into one buffer per dtype (:mod:`.boundary`) and the schedule's gradients kept
until Lightning's ``backward()`` (:mod:`.stash`).
"""

from lightning_mmpar.parallel.pipeline.engine import PipelineEngine, PipelineModule
from lightning_mmpar.parallel.pipeline.schedules import check_ownership, partition
from lightning_mmpar.parallel.pipeline.steps import PipelineChunk, PipelineSteps

__all__ = [
    "PipelineChunk",
    "PipelineEngine",
    "PipelineModule",
    "PipelineSteps",
    "check_ownership",
    "partition",
]
