"""Memory tiers, chunks and their tensor states, the chunk manager, the eviction/prefetch policy and NVMe I/O."""

from hetero.memory.chunk import Chunk, TensorSlot
from hetero.memory.manager import ChunkManager, MoveEvent
from hetero.memory.states import ChunkState, TensorState
from hetero.memory.tier import Tier

__all__ = ["Chunk", "ChunkManager", "ChunkState", "MoveEvent", "TensorSlot", "TensorState", "Tier"]
