"""Barycentric weights of query points over knots: which knots bracket a point, and how much each counts.

1-D: the two knots around the point (an interval). 2-D: the triangle of a Delaunay triangulation of
the knots that holds the point (three knots: their triangle); knots on one line fall back to the
segment along it, and bracket only points on that line. One knot brackets only itself. A point
exactly on a knot gets weight 1 there (the `exact` rung).
"""

from __future__ import annotations

import numpy as np
from scipy.spatial import Delaunay, QhullError

TOLERANCE = 1e-9


def barycentric(knots: np.ndarray, query: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(weights (q, k), inside (q,)): weights sum to 1 over the knots of the simplex holding each
    inside point (0 elsewhere); `knots` (k, d) and `query` (q, d) with d = 1 or 2."""
    knots, query = np.asarray(knots, np.float64), np.asarray(query, np.float64)
    q, k = query.shape[0], knots.shape[0]
    weights = np.zeros((q, k))
    if k == 0:
        return weights, np.zeros(q, bool)
    scale = np.maximum(np.abs(knots).max(axis=0), 1.0)
    knots, query = knots / scale, query / scale
    if k == 1:
        inside = np.all(np.abs(query - knots[0]) <= TOLERANCE, axis=1)
        weights[inside, 0] = 1.0
        return weights, inside
    if knots.shape[1] == 2:
        try:
            return _triangles(knots, query)
        except QhullError:  # collinear knots: interpolate along their line
            return _on_line(knots, query)
    return _interval(knots[:, 0], query[:, 0])


def _interval(knots: np.ndarray, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    order = np.argsort(knots, kind="stable")
    u = knots[order]
    weights = np.zeros((x.size, knots.size))
    inside = (x >= u[0] - TOLERANCE) & (x <= u[-1] + TOLERANCE)
    j = np.clip(np.searchsorted(u, x, side="right") - 1, 0, u.size - 2)
    span = np.where(u[j + 1] > u[j], u[j + 1] - u[j], 1.0)
    t = np.clip((x - u[j]) / span, 0.0, 1.0)
    rows = np.flatnonzero(inside)
    np.add.at(weights, (rows, order[j[rows]]), 1.0 - t[rows])
    np.add.at(weights, (rows, order[j[rows] + 1]), t[rows])
    return weights, inside


MESHES_KEPT = 512  # triangulations a process keeps (one per family, shape and pass size of the knots)
_MESHES: dict[bytes, Delaunay] = {}


def _mesh(knots: np.ndarray) -> Delaunay:
    """The Delaunay triangulation of the knots, built once per process for each set of knots (the
    same knots give the same triangulation: a pass priced again reuses it)."""
    key = np.ascontiguousarray(knots).tobytes() + repr(knots.shape).encode()
    mesh = _MESHES.get(key)
    if mesh is None:
        mesh = Delaunay(knots)
        if len(_MESHES) >= MESHES_KEPT:
            _MESHES.pop(next(iter(_MESHES)))
        _MESHES[key] = mesh
    return mesh


def _triangles(knots: np.ndarray, query: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    mesh = _mesh(knots)
    simplex = mesh.find_simplex(query, tol=TOLERANCE)
    inside = simplex >= 0
    weights = np.zeros((query.shape[0], knots.shape[0]))
    rows = np.flatnonzero(inside)
    transform = mesh.transform[simplex[rows]]  # (r, 3, 2): inverse affine map and origin
    partial = np.einsum("rij,rj->ri", transform[:, :2], query[rows] - transform[:, 2])
    local = np.clip(np.column_stack([partial, 1.0 - partial.sum(axis=1)]), 0.0, 1.0)
    local /= local.sum(axis=1, keepdims=True)
    np.add.at(weights, (np.repeat(rows, 3), mesh.simplices[simplex[rows]].ravel()), local.ravel())
    return weights, inside


def _on_line(knots: np.ndarray, query: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    span = knots.max(axis=0) - knots.min(axis=0)
    axis = int(np.argmax(span))
    weights, inside = _interval(knots[:, axis], query[:, axis])
    on_line = np.all(np.abs(weights @ knots - query) <= 1e-6, axis=1)
    inside &= on_line
    weights[~inside] = 0.0
    return weights, inside
