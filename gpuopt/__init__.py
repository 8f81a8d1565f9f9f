"""gpuopt: the training optimizations themselves, and a reference Trainer.

Precision, accumulation, data loading, checkpointing, fused kernels, compile, memory,
environment.

Never imports agent, gpuwatch, zmq or textual.
"""

from gpuopt.precision import MixedPrecision
from gpuopt.trainer import StepStats, Trainer

__all__ = ["MixedPrecision", "StepStats", "Trainer"]
