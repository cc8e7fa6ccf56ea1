"""Label-free scores of a feature extractor on a fixed set of tiles: one implementation for training health (the
EMA teacher in memory, `dinov3_core.train.health_probe`), the along-training kNN curve (eval checkpoints,
`evaluate.checkpoints`), the evaluate stage's health and the gram teacher choice (`effective_rank`).

* `effective_rank` — exp(entropy of the normalised singular values) of centred [N, D] features, / min(N, D) →
  [0, 1]: 0 when every tile gets the same vector (collapse, rounding noise aside), near 1 when the features use
  every direction;
* `invariance` — augmentation-invariance retrieval: each tile is embedded under two random augmentations (the
  two global crops of the training recipe); the share of view-A embeddings whose nearest view-B embedding
  (cosine) is the same tile's. Chance is 1/N; features that ignore what the augmentations change (crop, D4
  orientation, colour, stain, blur) and keep what tells tiles apart score high. A collapsed model scores chance.

Views are a pure function of (seed, group): tiles are taken in groups of `GROUP` (the last one padded by
wrapping around the set), each group augmented from its own generator, so any split of the groups over
processes sees the same pixels and the scores do not depend on the number of ranks.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from dinov3_core.data.augment import MultiCropAugmentation
from dinov3_core.data.augment_config import AugmentationConfig
from dinov3_core.train.step_batches import derive_seed

GROUP = 16  # tiles augmented from one generator (and embedded in one call)
PROBE_STREAM = 4  # random stream of the views, beside dinov3_core.train.step_batches's MASK / AUGMENT / TORCH streams

Embed = Callable[[Tensor], Tensor]  # normalised float images [B, 3, S, S] → CLS features [B, D]


# Features whose spread around their mean is below this share of their size are one vector plus rounding noise:
# centred, that noise would look full-rank (the rank is scale-free), so they count as collapsed.
CONSTANT_SPREAD = 1e-4


def effective_rank(features: Tensor) -> float:
    """exp(entropy of normalised singular values) of centred [N, D] features, / min(N, D) → [0, 1]; 0 when the
    features are constant up to `CONSTANT_SPREAD` of their norm."""
    f = features.double()
    x = f - f.mean(0, keepdim=True)
    if x.norm() <= CONSTANT_SPREAD * f.norm():
        return 0.0
    s = torch.linalg.svdvals(x)
    p = s / s.sum()
    p = p[p > 0]
    entropy = float(-(p * p.log()).sum())
    return math.exp(entropy) / min(x.shape)


def invariance(view_a: Tensor, view_b: Tensor) -> float:
    """Share of rows i of `view_a` [N, D] whose most cosine-similar row of `view_b` [N, D] is row i (top-1
    retrieval of a tile's other view among all tiles' other views; chance 1/N). Ties count as misses, so
    identical vectors for every tile (collapse) score 0, not 1."""
    a = F.normalize(view_a.double(), dim=-1)
    b = F.normalize(view_b.double(), dim=-1)
    sim = a @ b.T
    own = sim.diagonal()
    others = sim.masked_fill(torch.eye(len(sim), dtype=torch.bool, device=sim.device), -math.inf)
    return float((own > others.max(dim=1).values).double().mean()) if len(sim) > 1 else 0.0


@dataclass(frozen=True)
class ProbeViews:
    """How the tiles are shown to the model: a centre crop (for the rank) and two augmented views (invariance)."""

    augmentation: dict[str, Any]  # AugmentationConfig fields (the run's crops): the two global crops are the views
    clean_size: int  # centre crop side, a multiple of the patch size
    seed: int

    @classmethod
    def of(cls, crops: AugmentationConfig, patch_size: int, tile_size: int, seed: int) -> ProbeViews:
        """The training recipe's global crops; the clean view is the largest patch multiple ≤ tile and crop size."""
        aug = {f.name: _plain(getattr(crops, f.name)) for f in fields(AugmentationConfig)}
        aug["n_local_crops"] = 0  # only the two global crops are views
        side = min(tile_size, crops.global_size) // patch_size * patch_size
        if side < patch_size:
            raise ValueError(f"tiles of {tile_size} px are smaller than one {patch_size}-px patch")
        return cls(aug, side, seed)

    def as_dict(self) -> dict[str, Any]:
        return {"augmentation": self.augmentation, "clean_size": self.clean_size, "seed": self.seed}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ProbeViews:
        return cls(dict(d["augmentation"]), int(d["clean_size"]), int(d["seed"]))

    def render(self, tiles: Tensor, group: int) -> tuple[Tensor, Tensor, Tensor]:
        """Normalised float [B, 3, S, S] clean view, view A and view B of uint8 tiles [B, T, T, 3] (on their
        device); the views have the crop size, the clean view `clean_size`."""
        cfg = AugmentationConfig(**self.augmentation)
        # A CPU generator on any device: the training GPU and the evaluate stage's CPU draw the same views.
        generator = torch.Generator().manual_seed(derive_seed(self.seed, PROBE_STREAM, group))
        views = MultiCropAugmentation(cfg)(tiles, generator).global_stack  # [2, B, 3, g, g]
        x = tiles.permute(0, 3, 1, 2).float() / 255.0
        o, s = (x.shape[-1] - self.clean_size) // 2, self.clean_size
        mean = torch.tensor(cfg.mean, device=x.device).view(1, 3, 1, 1)
        std = torch.tensor(cfg.std, device=x.device).view(1, 3, 1, 1)
        return (x[:, :, o : o + s, o : o + s] - mean) / std, views[0], views[1]


def embed_group(embed: Embed, tiles: Tensor, group: int, views: ProbeViews) -> Tensor:
    """[3, B, D] float32 features (clean, view A, view B) of one group of uint8 tiles [B, T, T, 3]."""
    return torch.stack([embed(v).float() for v in views.render(tiles, group)])


def group_rows(n_tiles: int, group: int) -> list[int]:
    """Positions in the probe set of the tiles of `group` (the last group wraps around to stay `GROUP` long)."""
    return [(group * GROUP + i) % n_tiles for i in range(GROUP)]


def n_groups(n_tiles: int) -> int:
    return -(-n_tiles // GROUP)


def scores(features: Tensor, n_tiles: int) -> dict[str, float]:
    """`effective_rank` (clean views) and `invariance` (view A → view B) of [3, ≥n_tiles, D] group-ordered
    features; the wrapped padding of the last group is cut off first."""
    f = features[:, :n_tiles]
    return {"effective_rank": effective_rank(f[0]), "invariance": invariance(f[1], f[2])}


def score_tiles(embed: Embed, read: Callable[[list[int]], Tensor], n_tiles: int, views: ProbeViews) -> dict[str, float]:
    """Both scores in one process: `read(positions)` gives the uint8 tiles [B, T, T, 3] at those probe positions."""
    parts = [embed_group(embed, read(group_rows(n_tiles, g)), g, views) for g in range(n_groups(n_tiles))]
    return scores(torch.cat(parts, dim=1), n_tiles)


def _plain(value: Any) -> Any:
    return list(value) if isinstance(value, tuple) else value


__all__ = [
    "GROUP",
    "ProbeViews",
    "effective_rank",
    "embed_group",
    "group_rows",
    "invariance",
    "n_groups",
    "score_tiles",
    "scores",
]
