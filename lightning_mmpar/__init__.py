"""lightning_mmpar: tensor, pipeline, expert and data parallelism for multimodal models in Lightning.

Importing the package registers the ``"mm_parallel"`` strategy with Lightning.
"""

from lightning_mmpar.config import ParallelConfig
from lightning_mmpar.topology import ParallelDims

__all__ = ["ParallelConfig", "ParallelDims"]
__version__ = "0.1.0"
