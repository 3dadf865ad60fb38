"""Grid tensor parallelism: 2D (Optimus), 2.5D (Tesseract) and 3D layouts over the mesh's tensor group."""

from hetero.parallel.grid.apply import apply_grid_parallel, check_grid_plan
from hetero.parallel.grid.loss import grid_cross_entropy
from hetero.parallel.grid.mesh import MODES, Grid, grid_shape
from hetero.parallel.grid.shard import BlockShard

__all__ = ["MODES", "BlockShard", "Grid", "apply_grid_parallel", "check_grid_plan", "grid_cross_entropy", "grid_shape"]
