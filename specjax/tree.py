"""Candidate trees: paths of top-k ranks -> parents, depths, masks and retrieve paths (numpy, once).

A static tree is Medusa's format: a list of paths, each a tuple of top-k ranks, e.g.

    (0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0)

Path (r_1, .., r_d) is the node whose token is rank r_d of head d - 1's prediction, reached from
the node (r_1, .., r_{d-1}). The verified block is [root, node_1 .. node_N]: the root is the
pending token (depth 0, index 0), the nodes follow in (depth, path) order, so every parent comes
before its children and siblings sit together in rank order (the order tree verification tries
them). Everything here is derived once on the host from the hashable `Tree`; inside the compiled
step it is constants.

Dynamic trees (EAGLE-2) reuse the device side unchanged: verification in acceptance.py takes
`parents` [N+1] or [B,N+1] (index order = trial order, parent index < child index) and the
ancestor mask; `ancestors_from_parents` and `path_nodes` build what a dynamic tree needs on device.

Also here: `build_tree` (Medusa's greedy construction: the N nodes with the largest path
probability under per-head, per-rank accuracies, which maximises the expected accepted length
when heads err independently), `default_tree`, `expected_accepted` and `choose_budget` (the
node count that maximises predicted tokens per second on a measured cost curve c(T)).
"""

from __future__ import annotations

import dataclasses
import functools
import heapq
from typing import Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from specjax.errors import InputError


def _as_paths(paths) -> tuple[tuple[int, ...], ...]:
  """Any sequence of int sequences -> a tuple of int tuples (raises InputError on anything else)."""
  if isinstance(paths, (str, bytes)) or not isinstance(paths, (Sequence, np.ndarray)):
    raise InputError(f"tree={paths!r} is invalid: must be a list of paths, each a tuple of "
                     f"top-k ranks such as [(0,), (1,), (0, 0)]")
  out = []
  for p in paths:
    if isinstance(p, (str, bytes)) or not isinstance(p, (Sequence, np.ndarray)) or len(p) == 0:
      raise InputError(f"tree path {p!r} is invalid: each path is a non-empty tuple of top-k "
                       f"ranks, e.g. (0, 1)")
    if not all(isinstance(r, (int, np.integer)) and not isinstance(r, bool) and r >= 0 for r in p):
      raise InputError(f"tree path {tuple(p)!r} is invalid: ranks must be integers >= 0")
    out.append(tuple(int(r) for r in p))
  return tuple(out)


@dataclasses.dataclass(frozen=True)
class Tree:
  """A static candidate tree (hashable: a jit cache key). Build with `Tree(paths)`.

  N = num_nodes nodes plus the root; index 0 is the root, nodes are 1..N in (depth, path) order.
  Arrays (numpy, derived once):
    parent    [N+1] int32  parent index (root: -1)
    depth     [N+1] int32  root 0; position offset of each node from the pending token
    head      [N+1] int32  which head's prediction the node reads (depth - 1; root: -1)
    rank      [N+1] int32  which of that head's top-k (root: -1)
    ancestor  [N+1,N+1] bool  node i attends node j (j is i or an ancestor of i)
    path      [N+1,Dmax] int32  the nodes from depth 1 down to i (padded with 0 past depth[i])
    leaves    [L] int32  nodes with no children; path[leaves] are the root-to-leaf retrieve paths
  """
  paths: tuple

  def __post_init__(self):
    paths = _as_paths(self.paths)
    if not paths:
      raise InputError("tree is empty: give at least one path, e.g. [(0,)]")
    seen = set()
    for p in paths:
      if p in seen:
        raise InputError(f"tree path {p} is listed twice: every node must appear once")
      seen.add(p)
    for p in paths:
      if len(p) > 1 and p[:-1] not in seen:
        raise InputError(f"tree path {p} has no parent {p[:-1]} in the tree: list every prefix")
    object.__setattr__(self, "paths", tuple(sorted(paths, key=lambda p: (len(p), p))))

  # ---------------------------------------------------------------- derived arrays (cached)

  @functools.cached_property
  def _arrays(self) -> dict:
    paths = self.paths
    n = len(paths)
    index = {(): 0}
    for i, p in enumerate(paths):
      index[p] = i + 1
    parent = np.array([-1] + [index[p[:-1]] for p in paths], np.int32)
    depth = np.array([0] + [len(p) for p in paths], np.int32)
    rank = np.array([-1] + [p[-1] for p in paths], np.int32)
    dmax = int(depth.max())
    anc = np.eye(n + 1, dtype=bool)
    path = np.zeros((n + 1, dmax), np.int32)
    for i in range(1, n + 1):
      j = i
      while j > 0:
        anc[i, j] = True
        path[i, depth[j] - 1] = j
        j = parent[j]
      anc[i, 0] = True
    has_child = np.zeros(n + 1, bool)
    has_child[parent[1:]] = True
    return dict(parent=parent, depth=depth, head=depth - 1, rank=rank, ancestor=anc, path=path,
                leaves=np.flatnonzero(~has_child).astype(np.int32))

  @property
  def parent(self) -> np.ndarray:
    return self._arrays["parent"]

  @property
  def depth(self) -> np.ndarray:
    return self._arrays["depth"]

  @property
  def head(self) -> np.ndarray:
    return self._arrays["head"]

  @property
  def rank(self) -> np.ndarray:
    return self._arrays["rank"]

  @property
  def ancestor(self) -> np.ndarray:
    return self._arrays["ancestor"]

  @property
  def path(self) -> np.ndarray:
    return self._arrays["path"]

  @property
  def leaves(self) -> np.ndarray:
    return self._arrays["leaves"]

  @property
  def num_nodes(self) -> int:
    """N (the root, the pending token, is not counted)."""
    return len(self.paths)

  @property
  def max_depth(self) -> int:
    return max(len(p) for p in self.paths)

  @property
  def max_rank(self) -> int:
    return max(max(p) for p in self.paths)

  def ranks_needed(self) -> int:
    """How many top-k candidates per head the tree reads (max rank + 1)."""
    return self.max_rank + 1

  def take(self, cands):
    """The nodes' tokens [B,N] from ranked candidates [B,heads,R] (R >= ranks_needed()): node i
    takes rank rank[i] of head head[i]."""
    return cands[:, self.head[1:], self.rank[1:]]

  def __repr__(self):
    return f"Tree(N={self.num_nodes}, depth={self.max_depth}, top_k={self.ranks_needed()})"


def as_tree(tree) -> Tree | None:
  """`tree` as a Tree: None and Trees as they are, paths (a list of rank tuples) built into one."""
  return tree if tree is None or isinstance(tree, Tree) else Tree(tree)


def chain(depth: int) -> Tree:
  """The chain tree (0,), (0, 0), ...: one candidate per head."""
  return Tree([(0,) * d for d in range(1, depth + 1)])


# ----------------------------------------------------------------------------- device helpers


def ancestors_from_parents(parents: jax.Array, max_depth: int) -> jax.Array:
  """parents [...,N+1] (root -1) -> ancestor mask [...,N+1,N+1] (self included), for trees built
  on device. Needs parent index < child index; max_depth bounds the walk."""
  n1 = parents.shape[-1]
  idx = jnp.broadcast_to(jnp.arange(n1), parents.shape)
  anc = idx[..., :, None] == jnp.arange(n1)  # self
  cur = idx
  for _ in range(max_depth):
    cur = jnp.take_along_axis(parents, jnp.maximum(cur, 0), axis=-1)
    cur = jnp.where(cur >= 0, cur, jnp.where(idx == 0, -1, 0))  # the walk ends at the root
    anc = anc | ((cur[..., :, None] == jnp.arange(n1)) & (cur[..., :, None] >= 0))
  return anc


def path_nodes(ancestor_row: jax.Array, depth: jax.Array, max_depth: int) -> jax.Array:
  """The nodes from depth 1 down to a chosen node: ancestor_row [B,N+1] (the chosen node's row of
  the ancestor mask), depth [N+1] or [B,N+1] -> [B,max_depth] int32 (0 past the node's depth)."""
  d = jnp.arange(1, max_depth + 1)
  hit = ancestor_row[:, None, :] & (jnp.broadcast_to(depth, ancestor_row.shape)[:, None, :]
                                    == d[None, :, None])  # [B,Dmax,N+1]
  return jnp.argmax(hit, axis=-1).astype(jnp.int32)


# ----------------------------------------------------------------------------- construction


def _check_accuracies(acc) -> np.ndarray:
  a = np.asarray(acc, np.float64)
  if a.ndim != 2 or a.size == 0 or not np.all(np.isfinite(a)) or a.min() < 0 or a.max() > 1:
    raise InputError(f"accuracies must be a [num_heads, top_k] array of probabilities in [0, 1] "
                     f"(head k's rank-r candidate is the right token), got shape {a.shape}")
  return a


def build_tree(accuracies, num_nodes: int) -> Tree:
  """Medusa's greedy construction: the `num_nodes` nodes of largest path probability.

  accuracies [K,R]: accuracies[k, r] = P(head k's rank-r token is the correct one), e.g. measured
  top-(r+1) minus top-r accuracy on held-out text. Assuming heads err independently, node
  (r_1..r_d) is accepted with probability prod_i accuracies[i-1, r_i], and the expected number of
  accepted tokens is the sum over nodes; the top-N set maximises it and is closed under parents
  (a child is never likelier than its parent; ties go to the shallower, lower-rank node).
  """
  a = _check_accuracies(accuracies)
  from specjax.errors import check_int

  check_int("num_nodes", num_nodes, 1)
  k, r = a.shape
  heap = [(-a[0, j], (j,)) for j in range(r)]
  heapq.heapify(heap)
  chosen = []
  while heap and len(chosen) < num_nodes:
    negp, path = heapq.heappop(heap)
    chosen.append(path)
    if len(path) < k:
      for j in range(r):
        heapq.heappush(heap, (negp * a[len(path), j], path + (j,)))
  return Tree(chosen)


def expected_accepted(tree: Tree, accuracies) -> float:
  """Expected accepted draft tokens per step (tau - 1) under independent per-head accuracies."""
  a = _check_accuracies(accuracies)
  total = 0.0
  for p in tree.paths:
    if len(p) > a.shape[0] or max(p) >= a.shape[1]:
      continue  # nodes the accuracies do not cover count as never accepted
    total += float(np.prod([a[d, r] for d, r in enumerate(p)]))
  return total


# Per-rank accuracies used by `default_tree`: Medusa's reported top-1 for Vicuna-7B's heads
# (0.56 / 0.32 / 0.20 / 0.15 / 0.12), each later rank taking a geometric share of the rest.
def prior_accuracies(num_heads: int, top_k: int = 10) -> np.ndarray:
  top1 = [0.56, 0.32, 0.20, 0.15, 0.12]
  top1 += [top1[-1] * 0.8 ** i for i in range(1, max(0, num_heads - 5) + 1)]
  out = np.zeros((num_heads, top_k))
  for k in range(num_heads):
    out[k] = top1[k] * 0.45 ** np.arange(top_k)
  return out


def per_rank_accuracy(meta: Mapping, num_heads: int, ranks: int = 5) -> np.ndarray | None:
  """[K, ranks] P(head k's rank-r token is right), from trained heads' held-out top-1 / top-5
  (`Heads.meta["held_out"]`: top1_k, top5_k): the 4 ranks after the first share top-5 - top-1,
  decaying geometrically. None when the heads carry no held-out numbers (random heads: use
  `prior_accuracies`). This is what `build_tree` and `choose_budget` read."""
  held = meta.get("held_out", {})
  if not any(f"top1_{k}" in held for k in range(num_heads)):
    return None
  out = np.zeros((num_heads, ranks))
  w = 0.5 ** np.arange(ranks - 1)
  w = w / w.sum()
  for k in range(num_heads):
    t1, t5 = float(held.get(f"top1_{k}", 0.0)), float(held.get(f"top5_{k}", 0.0))
    out[k, 0] = t1
    out[k, 1:] = max(t5 - t1, 0.0) * w
  return out


def capacity(depth: int, top_k: int) -> int:
  """How many nodes EAGLE-2's expansion drafts to `depth` keeping `top_k` per level (and the most
  a dynamic tree's num_nodes can keep)."""
  return top_k + (depth - 1) * top_k * top_k


def default_tree(num_heads: int, num_nodes: int = 15) -> Tree:
  """The tree `build_tree` gives for `prior_accuracies` (use measured ones when you have them)."""
  from specjax.errors import check_int

  check_int("num_heads", num_heads, 1)
  return build_tree(prior_accuracies(num_heads), num_nodes)


def interpolate_cost(cost: Mapping[int, float], t: int) -> float:
  """c(T) from measured points {T: cost relative to a 1-token forward}: linear between points,
  extended with the last segment's slope (flat below the first point).

  A forward over more tokens never costs less than one over fewer, so the points are first made
  non-decreasing (each is raised to the largest cost measured at a smaller T): a noisy curve with
  c(8) < c(2) would otherwise make a bigger tree look cheaper than a smaller one."""
  pts = sorted((int(k), float(v)) for k, v in cost.items())
  if not pts or any(k < 1 or not v > 0 for k, v in pts):
    raise InputError(f"cost must map token counts >= 1 to positive costs, got {dict(cost)!r}")
  xs = np.array([p[0] for p in pts], float)
  ys = np.maximum.accumulate(np.array([p[1] for p in pts], float))
  if t <= xs[0]:
    return float(ys[0])
  if t >= xs[-1]:
    slope = (ys[-1] - ys[-2]) / (xs[-1] - xs[-2]) if len(xs) > 1 else 0.0
    return float(ys[-1] + slope * (t - xs[-1]))
  return float(np.interp(t, xs, ys))


def choose_budget(cost: Mapping[int, float], accuracies, *, max_nodes: int = 64,
                  step_overhead: float = 0.0) -> dict:
  """Picks the node count that maximises predicted tokens per second.

  cost: the measured c(T) (a T-token forward relative to one token), e.g.
  {1: 1, 2: 1.53, 4: 1.71, 8: 2.15, 16: 2.82}; accuracies [K,R] as for `build_tree`;
  step_overhead: the heads' and verification's extra cost per step, in one-token forwards.
  Predicted speedup over autoregressive for N nodes: (1 + E[accepted](N)) / (c(N + 1) + overhead).
  Returns {"num_nodes", "tree", "speedup", "tau", "table": [(N, tau, cost, speedup), ...]}.
  """
  from specjax.errors import check_int

  check_int("max_nodes", max_nodes, 1)
  a = _check_accuracies(accuracies)
  table, best = [], None
  for n in range(1, max_nodes + 1):
    tree = build_tree(a, n)
    tau = 1.0 + expected_accepted(tree, a)
    c = interpolate_cost(cost, n + 1) + step_overhead
    row = (n, tau, c, tau / c)
    table.append(row)
    if best is None or row[3] > best[0][3]:
      best = (row, tree)
  (n, tau, _, speed), tree = best
  return {"num_nodes": n, "tree": tree, "speedup": speed, "tau": tau, "table": table}


def chain_tau(acceptance: Sequence[float], gamma: int) -> float:
  """Expected tokens per step of a chain of `gamma` drafts: tau = 1 + sum_i prod_{j<=i} a_j, with
  a_j the probability that draft j is accepted given drafts 1..j-1 were (positions past the list
  take its last entry)."""
  a = [min(max(float(x), 0.0), 1.0) for x in acceptance] or [0.0]
  tau, run = 1.0, 1.0
  for i in range(gamma):
    run *= a[min(i, len(a) - 1)]
    tau += run
  return tau


def choose_chain(cost: Mapping[int, float], acceptance: Sequence[float], *, draft_cost: float = 0.0,
                 max_gamma: int = 16, step_overhead: float = 0.0) -> dict:
  """`choose_budget` for a chain: the gamma that maximises predicted tokens per second.

  Predicted speedup over autoregressive for gamma drafts:
      tau(gamma) / (c(gamma + 1) + gamma * draft_cost + step_overhead)
  with tau from `chain_tau` (per-position acceptance a_i), c the measured cost curve and
  draft_cost one drafted token's cost in one-token target forwards (Leviathan et al.'s c).
  Returns {"gamma", "tau", "speedup", "table": [(gamma, tau, cost, speedup), ...]}."""
  from specjax.errors import check_int

  check_int("max_gamma", max_gamma, 1)
  table = []
  for g in range(1, max_gamma + 1):
    tau = chain_tau(acceptance, g)
    c = interpolate_cost(cost, g + 1) + g * draft_cost + step_overhead
    table.append((g, tau, c, tau / c))
  g, tau, _, speed = max(table, key=lambda r: (r[3], -r[0]))
  return {"gamma": g, "tau": tau, "speedup": speed, "table": table}
