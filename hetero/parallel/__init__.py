"""Tensor, pipeline and data parallelism: the mesh of process groups and each parallelism in its own module."""

from hetero.parallel.mesh import Mesh

__all__ = ["Mesh"]
