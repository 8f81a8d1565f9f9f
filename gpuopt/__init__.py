"""gpuopt: the training optimizations themselves (precision, accumulation, data loading,
checkpointing, fused kernels, compile, memory, environment) and a reference Trainer.

Never imports agent, gpuwatch, zmq or textual.
"""

from gpuopt.precision import MixedPrecision
from gpuopt.trainer import StepStats, Trainer

__all__ = ["MixedPrecision", "StepStats", "Trainer"]
