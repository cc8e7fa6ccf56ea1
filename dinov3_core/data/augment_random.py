"""Every random choice of the multi-crop augmentation, per image, from one `torch.Generator` (or one per group of
images): `Random` and `GroupedRandom`, shared by the geometry (`dinov3_core.data.augment`) and the colour steps
(`photometric`, `stain`)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor


class Random:
    """Draws from one generator (on its own device) and moves the small parameter tensors to the data.

    Every draw's first dimension is the crop-major row (crop c of image i is row c·B + i) or the image."""

    def __init__(self, generator: torch.Generator | None, device: torch.device) -> None:
        self.generator = generator
        self.source_device = generator.device if generator is not None else torch.device("cpu")
        self.device = device

    def _rand(self, shape: tuple[int, ...], dtype: torch.dtype) -> Tensor:
        return torch.rand(shape, generator=self.generator, device=self.source_device, dtype=dtype)

    def _randn(self, shape: tuple[int, ...]) -> Tensor:
        return torch.randn(shape, generator=self.generator, device=self.source_device, dtype=torch.float64)

    def _randint(self, high: int, shape: tuple[int, ...]) -> Tensor:
        return torch.randint(0, high, shape, generator=self.generator, device=self.source_device)

    def uniform(self, low: float, high: float, *shape: int) -> Tensor:
        u = self._rand(shape, torch.float64)
        return (low + (high - low) * u).to(self.device, torch.float32)

    def bernoulli(self, p: Tensor | float, *shape: int) -> Tensor:
        u = self._rand(shape, torch.float64)
        return (u < torch.as_tensor(p, dtype=torch.float64, device=self.source_device)).to(self.device)

    def normal(self, *shape: int) -> Tensor:
        return self._randn(shape).to(self.device, torch.float32)

    def integers(self, high: int, *shape: int) -> Tensor:
        return self._randint(high, shape).to(self.device)

    def permutations(self, n: int, k: int) -> Tensor:
        """[n, k]: an independent random permutation of range(k) per row."""
        return self._rand((n, k), torch.float32).argsort(dim=1).to(self.device)


class GroupedRandom(Random):
    """Draws for a batch made of equal groups of consecutive images, each group from its own generator, exactly
    as `Random` would draw them for that group alone: a draw of n = S·B rows takes S·g rows from each group's
    generator (crop-major within the group) and interleaves them into the batch's crop-major rows. The pixel
    work then runs once over the whole batch instead of once per group (per-group calls cost their kernel
    launches again and again, which dominates at one image a group)."""

    def __init__(self, generators: list[torch.Generator], images: int, device: torch.device) -> None:
        if not generators or images % len(generators):
            raise ValueError(f"{len(generators)} generators cannot split a batch of {images} images into equal groups")
        super().__init__(generators[0], device)
        self.generators, self.images, self.group = generators, images, images // len(generators)

    def _grouped(self, shape: tuple[int, ...], draw: Callable[[torch.Generator, tuple[int, ...]], Tensor]) -> Tensor:
        n, rest = shape[0], shape[1:]
        if n % self.images:
            raise ValueError(f"a draw of {n} rows is not crop-major over {self.images} images")
        crops = n // self.images
        parts = [draw(g, (crops * self.group, *rest)).view(crops, self.group, *rest) for g in self.generators]
        return torch.stack(parts, dim=1).reshape(shape)

    def _rand(self, shape: tuple[int, ...], dtype: torch.dtype) -> Tensor:
        return self._grouped(shape, lambda g, s: torch.rand(s, generator=g, device=g.device, dtype=dtype))

    def _randn(self, shape: tuple[int, ...]) -> Tensor:
        return self._grouped(shape, lambda g, s: torch.randn(s, generator=g, device=g.device, dtype=torch.float64))

    def _randint(self, high: int, shape: tuple[int, ...]) -> Tensor:
        return self._grouped(shape, lambda g, s: torch.randint(0, high, s, generator=g, device=g.device))


__all__ = ["GroupedRandom", "Random"]
