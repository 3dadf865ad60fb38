"""hetero: train models larger than GPU memory on chunks spread over GPU, host memory and NVMe."""

from hetero.config import Config, LogConfig, LossScaleConfig, MemoryConfig, OffloadConfig, ParallelConfig, parse_size
from hetero.engine import Engine, initialize
from hetero.errors import (
    CheckpointError,
    ConfigError,
    HeteroError,
    IllegalTransitionError,
    NvmeCorruptError,
    NvmeError,
    NvmeSpaceError,
    NvmeUnavailableError,
    StepOrderError,
    TierOutOfMemoryError,
    WeightsError,
)
from hetero.lazy import lazy_init
from hetero.profiler import estimate, plan, profile

__version__ = "0.1.0"

__all__ = [
    "Config",
    "Engine",
    "initialize",
    "ConfigError",
    "HeteroError",
    "IllegalTransitionError",
    "LogConfig",
    "LossScaleConfig",
    "MemoryConfig",
    "NvmeCorruptError",
    "NvmeError",
    "NvmeSpaceError",
    "NvmeUnavailableError",
    "OffloadConfig",
    "ParallelConfig",
    "StepOrderError",
    "TierOutOfMemoryError",
    "parse_size",
    "CheckpointError",
    "estimate",
    "plan",
    "profile",
    "WeightsError",
    "lazy_init",
]
