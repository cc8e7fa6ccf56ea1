"""2-rank check of Sinkhorn-Knopp under torch.distributed (gloo): each rank holds a slice of the batch; the
all-reduced result must equal the single-process result on the concatenated batch.

Run: OMP_NUM_THREADS=1 python -m torch.distributed.run --standalone --nproc-per-node=2 \
    tests/dist_scripts/ssl_sinkhorn.py
Exits non-zero on any mismatch; rank 0 prints SSL_SINKHORN_OK on success.
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist

from dinov3_core.losses import dino_teacher_targets, ibot_teacher_targets, sinkhorn_knopp


def main() -> int:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    # Every rank needs a group containing only itself for the single-process reference (new_group is
    # collective, so all ranks create all of them).
    solo = [dist.new_group([r]) for r in range(world)][rank]
    gen = torch.Generator().manual_seed(0)
    failures: list[str] = []

    def check(name: str, got: torch.Tensor, expected: torch.Tensor) -> None:
        if got.shape != expected.shape or not torch.allclose(got, expected, rtol=1e-5, atol=1e-7):
            diff = (got - expected).abs().max().item() if got.shape == expected.shape else "shape"
            failures.append(f"rank {rank}: {name} mismatch (max diff {diff})")

    # DINO-style: equal rows per rank, [S_g, B, K] per rank, large logits (stability path included).
    full_cls = torch.randn(2, 4 * world, 32, generator=gen) * 3.0
    local_cls = full_cls[:, rank * 4 : (rank + 1) * 4]
    expected = dino_teacher_targets(full_cls, 0.04, group=solo)[:, rank * 4 : (rank + 1) * 4]
    check("dino targets", dino_teacher_targets(local_cls, 0.04), expected)

    # iBOT-style: unequal masked-patch counts per rank, padded to a common static upper bound.
    counts = [5, 11][:world] + [7] * max(0, world - 2)
    rows = [torch.randn(c, 24, generator=gen) for c in counts]
    expected = ibot_teacher_targets(torch.cat(rows), 0.07, group=solo)
    start = sum(counts[:rank])
    mine = expected[start : start + counts[rank]]
    upper = max(counts)
    padded = torch.cat([rows[rank], torch.randn(upper - counts[rank], 24, generator=gen) * 100])
    got = ibot_teacher_targets(padded, 0.07, torch.tensor([counts[rank]]))
    check("ibot targets (padded, uneven)", got[: counts[rank]], mine)
    if (got[counts[rank] :] != 0).any():
        failures.append(f"rank {rank}: padding rows are not zero")
    check("ibot targets (unpadded, uneven)", sinkhorn_knopp(rows[rank], 0.07), mine)

    dist.barrier()
    all_failures: list[list[str]] = [[] for _ in range(world)]
    dist.all_gather_object(all_failures, failures)
    dist.destroy_process_group()
    flat = [f for per_rank in all_failures for f in per_rank]
    if flat:
        if rank == 0:
            print("\n".join(flat), file=sys.stderr)
        return 1
    if rank == 0:
        print("SSL_SINKHORN_OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
