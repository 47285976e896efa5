"""A token tree's shape, as the runners verify it in one forward (ModelRunner.forward_tree).

Tree attention after SpecInfer (Miao et al. 2024, arXiv 2305.09781): the n new tokens of a forward form a
tree given by their parents (parents[i] < i, -1 for a child of the last cached token).  Token i sits at
position cached + depth(i) and attends to the cached tokens and to its ancestors and itself only: exactly
the keys a chain forward over its root-to-node path would show it, in the same order.  This module turns
the parents into what the backends need: depths (rotary positions), each node's path, the visible new rows
in the layout of the attention kernel's tree mode (kernels/attention.c: tree_at, tree_rows), the visible
positions of one row (the PyTorch paths), and the checks of a tree and of a kept path.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


class Tree:
    """The shape of n new tokens given by their parents (see the module doc)."""

    def __init__(self, parents: Sequence[int], n: int | None = None) -> None:
        """`parents` of n tokens (n, where given, must be its length): a ValueError unless each parent is
        -1 or an earlier token's index."""
        parents = [int(p) for p in parents]
        if n is not None and len(parents) != n:
            raise ValueError(f"{len(parents)} parents for {n} tree tokens")
        if not parents or any(not -1 <= p < i for i, p in enumerate(parents)):
            raise ValueError(f"a tree's parents must be -1 or an earlier token's index: {parents}")
        self.parents = parents
        self.paths: list[list[int]] = []  # node i's root-to-node path (node indices), itself last
        for i, p in enumerate(parents):
            self.paths.append([*(self.paths[p] if p >= 0 else []), i])
        self.depths = [len(path) - 1 for path in self.paths]
        self.depth_index = torch.tensor(self.depths, dtype=torch.long)  # [n]
        # the kernel's tree mode: row i sees new rows rows[at[i]:at[i + 1]]
        self.at = torch.tensor([0, *torch.tensor([len(p) for p in self.paths]).cumsum(0).tolist()],
                               dtype=torch.int32)  # [n + 1]
        self.rows = torch.tensor([j for path in self.paths for j in path], dtype=torch.int32)  # [at[n]]

    def __len__(self) -> int:
        return len(self.parents)

    def visible(self, i: int, start: int, window: int | None = None) -> list[int]:
        """The positions of the keys row i sees when the new rows sit at start .. start + n - 1: the cached
        ones, then its ancestors' rows and its own, the last `window` of them where a window is given."""
        seen = [*range(start), *(start + j for j in self.paths[i])]
        return seen[-window:] if window else seen

    def path_rows(self, rows: Sequence[int]) -> list[int]:
        """`rows` as a list after checking that they are a root-to-node path of this tree, in order (a
        ValueError otherwise); no rows is the empty path."""
        rows = [int(r) for r in rows]
        if rows and (not 0 <= rows[-1] < len(self) or self.paths[rows[-1]] != rows):
            raise ValueError(f"rows {rows} are not a root-to-node path of the tree {self.parents}")
        return rows


# Below, `pending` is a runner's unsettled forward_tree: (the tokens cached before it, its tree) until
# keep_rows, a rollback to at most those tokens, or reset settles it; None when there is none.


def check_forward(pending: tuple[int, Tree] | None) -> None:
    """A forward's check: no forward_tree waits for keep_rows (a ValueError otherwise)."""
    if pending is not None:
        raise ValueError("a forward after forward_tree: call keep_rows (or rollback) first")


def check_rollback(pending: tuple[int, Tree] | None, n: int) -> None:
    """rollback(n)'s checks: n >= 0, and not into an unsettled tree (its tokens are no sequence)."""
    if n < 0:
        raise ValueError(f"rollback to a negative length {n}")
    if pending is not None and n > pending[0]:
        raise ValueError("rollback into a token tree: call keep_rows first")


def kept_rows(pending: tuple[int, Tree] | None, cached: int, rows: Sequence[int]) -> list[int]:
    """keep_rows(cached, rows)'s checks: a forward_tree over `cached` tokens waits, and `rows` are a
    root-to-node path of its tree (a ValueError otherwise); the rows as a list."""
    if pending is None or pending[0] != cached:
        raise ValueError(f"keep_rows({cached}, ...) without a forward_tree over {cached} cached tokens")
    return pending[1].path_rows(rows)
