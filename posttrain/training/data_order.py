"""Deterministic, resumable data order shared by the recipes."""

from __future__ import annotations

import torch

from posttrain.errors import UserError


class EpochSampler:
    """Deterministic data order: epoch e visits items in randperm(n, seed + e). Position is resumable."""

    def __init__(self, n: int, seed: int, shuffle: bool = True):
        if n == 0:
            raise UserError("no training rows left after filtering")
        self.n, self.seed, self.shuffle = n, seed, shuffle
        self.epoch, self.index = 0, 0
        self._order = self._make_order()

    def _make_order(self) -> list[int]:
        if not self.shuffle:
            return list(range(self.n))
        g = torch.Generator().manual_seed(self.seed * 1000003 + self.epoch)
        return torch.randperm(self.n, generator=g).tolist()

    def take(self, k: int) -> list[int]:
        out = []
        while len(out) < k:
            if self.index == self.n:
                self.epoch, self.index = self.epoch + 1, 0
                self._order = self._make_order()
            out.append(self._order[self.index])
            self.index += 1
        return out

    def state(self) -> dict:
        return {"epoch": self.epoch, "index": self.index, "n": self.n}

    def load(self, state: dict, data: str = "the data") -> None:
        """Continue at a checkpoint's position; refused when the data has another number of items than the
        run that wrote it (its permutation would index rows that are gone, or skip new ones)."""
        saved = state.get("n")
        if saved is not None and saved != self.n:
            raise UserError(f"resume: {data} has {self.n} training items, the checkpoint's run had {saved}: resume "
                            "with the data it was trained on, or start a new run in another output_dir")
        self.epoch, self.index = state["epoch"], state["index"]
        self._order = self._make_order()
