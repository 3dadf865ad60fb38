"""hetero: train models larger than GPU memory on chunks spread over GPU, host memory and NVMe."""

from hetero.config import Config, MemoryConfig, OffloadConfig, ParallelConfig, parse_size
from hetero.engine import Engine, initialize
from hetero.errors import (
    ConfigError,
    HeteroError,
    IllegalTransitionError,
    NvmeCorruptError,
    NvmeError,
    NvmeSpaceError,
    NvmeUnavailableError,
    TierOutOfMemoryError,
)

__version__ = "0.1.0"

__all__ = [
    "Config",
    "Engine",
    "initialize",
    "ConfigError",
    "HeteroError",
    "IllegalTransitionError",
    "MemoryConfig",
    "NvmeCorruptError",
    "NvmeError",
    "NvmeSpaceError",
    "NvmeUnavailableError",
    "OffloadConfig",
    "ParallelConfig",
    "TierOutOfMemoryError",
    "parse_size",
]
