"""The process grid of a 2D, 2.5D or 3D tensor-parallel layout, carved out of the mesh's tensor group.

[Note: grid layouts]
The tensor group of T ranks is arranged as a grid, and every activation [batch, seq, hidden] of the residual stream
is cut over two groups of it: `main.hidden` splits the hidden dimension and `main.batch` the batch (the sequence
stays whole). Tensor ranks are numbered (fastest last):

| mode | T | tensor rank | main.hidden | main.batch | weight sub-parts over |
| --- | --- | --- | --- | --- | --- |
| 2d (Optimus, SUMMA) | q^2 | i q + j | row i: j varies | column j: i varies | the column |
| 2.5d (Tesseract) | q^2 d | k q^2 + i q + j | as 2d, in depth layer k | depth, then column | the column |
| 3d (Bian et al.) | q^3 | a q^2 + b q + c | b varies | the plane of fixed b (a, c vary) | the a-line |

2D: rank (i, j) holds X_ij (batch part i, hidden part j) and W_ij; SUMMA's q broadcast steps along a row and a
column deliver the row's X blocks and the column's W blocks, so a product is an all-gather of X over the row and of
W over the column, a local product, nothing more: the output has the input's layout. 2.5D runs d such grids, each
on its own slice of the batch, with the same weights (replicated over the depth group, their gradients summed over
it). 3D runs Agarwal's product: C_ab = sum_c A_ac B_cb with rank (a, b, c) computing one term, so an output leaves
the product reduce-scattered over the third axis and the roles of the b and c axes swap (`alt`): a column-parallel
layer of the plan takes the stream in `main` and leaves its output in `alt` (heads split over c), the row-parallel
layer after it returns to `main`. In 2D and 2.5D, `alt` is `main`.

Within every group, group rank order is global rank order (Comm.split), which the numbering above makes the order of
the parts: the plane of fixed b lists (a, c) as a q + c, the plane of fixed c lists (a, b) as a q + b.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hetero.comm import Comm
from hetero.config import TENSOR_MODES, grid_shape
from hetero.parallel.shape_comm import ShapeComm

MODES = TENSOR_MODES


@dataclass(frozen=True)
class Place:
    """A tensor rank's block indices in each layout (pure arithmetic; the same table on every rank)."""

    main_h: int  # hidden part of the residual stream
    main_b: int  # batch part within main.batch
    alt_h: int  # hidden part between a column- and a row-parallel layer (3D; = main_h otherwise)
    alt_b: int
    w: int  # sub-part of a weight block (its rank in the weight-gather group)
    outer: int  # depth layer (2.5D; 0 otherwise)


def place_of(mode: str, q: int, r: int) -> Place:
    """Tensor rank r's indices ([Note: grid layouts])."""
    if mode == "3d":
        a, b, c = r // (q * q), (r // q) % q, r % q
        return Place(main_h=b, main_b=a * q + c, alt_h=c, alt_b=a * q + b, w=a, outer=0)
    k, i, j = r // (q * q), (r // q) % q, r % q
    return Place(main_h=j, main_b=i, alt_h=j, alt_b=i, w=i, outer=k)


@dataclass(frozen=True, eq=False)
class Orient:
    """One layout of activations: which group splits the hidden dimension, which the batch."""

    hidden: Any  # a Comm, or a ShapeComm (shape_comm.py)
    batch: Any


@dataclass(frozen=True, eq=False)
class Grid:
    mode: str
    q: int
    depth: int
    tp: Any  # the tensor group
    main: Orient  # the residual stream's layout
    alt: Orient  # between a column-parallel layer and the row-parallel one after it (3D); main otherwise
    wgroup: Any  # the group over which a weight block's sub-parts are gathered
    outer: Any  # 2.5D: the depth group (cuts the batch first; weights replicated over it); size 1 otherwise

    @property
    def rank(self) -> int:
        return self.tp.rank

    @property
    def batch_parts(self) -> int:
        """Parts the batch is cut into: a rank holds part `batch_index` of them."""
        return self.outer.size * self.main.batch.size

    @property
    def batch_index(self) -> int:
        return self.outer.rank * self.main.batch.size + self.main.batch.rank

    def place(self, r: int) -> Place:
        return place_of(self.mode, self.q, r)

    def places(self) -> list[Place]:
        return [self.place(r) for r in range(self.tp.size)]

    @classmethod
    def build(cls, tp: Comm, mode: str, depth: int | None = None) -> Grid:
        """Split the tensor group into the grid's groups. Every rank of `tp` calls this with the same arguments."""
        q, d = grid_shape(mode, tp.size, depth)
        if mode == "3d":
            at = lambda a, b, c: a * q * q + b * q + c  # noqa: E731
            r = range(q)
            a_line = tp.split([[at(a, b, c) for a in r] for b in r for c in r])
            b_line = tp.split([[at(a, b, c) for b in r] for a in r for c in r])
            c_line = tp.split([[at(a, b, c) for c in r] for a in r for b in r])
            plane_b = tp.split([[at(a, b, c) for a in r for c in r] for b in r])
            plane_c = tp.split([[at(a, b, c) for a in r for b in r] for c in r])
            main, alt = Orient(hidden=b_line, batch=plane_b), Orient(hidden=c_line, batch=plane_c)
            return cls(mode=mode, q=q, depth=1, tp=tp, main=main, alt=alt, wgroup=a_line, outer=Comm())
        at2 = lambda k, i, j: k * q * q + i * q + j  # noqa: E731
        r, rd = range(q), range(d)
        row = tp.split([[at2(k, i, j) for j in r] for k in rd for i in r])
        col = tp.split([[at2(k, i, j) for i in r] for k in rd for j in r])
        depth_group = tp.split([[at2(k, i, j) for k in rd] for i in r for j in r]) if d > 1 else Comm()
        main = Orient(hidden=row, batch=col)
        return cls(mode=mode, q=q, depth=d, tp=tp, main=main, alt=main, wgroup=col, outer=depth_group)

    @classmethod
    def shape_only(cls, mode: str, tensor: int, depth: int | None = None, rank: int = 0) -> Grid:
        """A grid with the sizes and this rank's indices but no process groups: for checks before anything changes,
        and for the estimator's shapes. Its groups are `ShapeComm`s."""
        q, d = grid_shape(mode, tensor, depth)
        p = place_of(mode, q, rank)
        if mode == "3d":
            main = Orient(hidden=ShapeComm(p.main_h, q), batch=ShapeComm(p.main_b, q * q))
            alt = Orient(hidden=ShapeComm(p.alt_h, q), batch=ShapeComm(p.alt_b, q * q))
            return cls(
                mode=mode,
                q=q,
                depth=1,
                tp=ShapeComm(rank, tensor),
                main=main,
                alt=alt,
                wgroup=ShapeComm(p.w, q),
                outer=ShapeComm(0, 1),
            )
        main = Orient(hidden=ShapeComm(p.main_h, q), batch=ShapeComm(p.main_b, q))
        return cls(
            mode=mode,
            q=q,
            depth=d,
            tp=ShapeComm(rank, tensor),
            main=main,
            alt=main,
            wgroup=ShapeComm(p.w, q),
            outer=ShapeComm(p.outer, d),
        )

    def __repr__(self) -> str:
        p = self.place(self.rank)
        return f"Grid({self.mode}, q={self.q}, depth={self.depth}, rank={self.rank}, {p})"
