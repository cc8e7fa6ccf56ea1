"""Pipeline parallelism of the student (issue 14): the contract, the split, and parity with the unsplit step."""

from __future__ import annotations

import json

import pytest

from tests.helpers import DIST_SCRIPTS, torchrun


def test_split_keeps_fqns() -> None:
    import torch
    from torch import nn

    from dinov3_core.models import HUB_SETTINGS, DINOHead, build_backbone
    from dinov3_core.train.parallel_config import ParallelismConfig, split_blocks
    from dinov3_core.train.pipeline_parallel import split_student, stage_owners

    p = ParallelismConfig(pp_degree=2)
    assert [list(r) for r in split_blocks(p, 5)] == [[0, 1, 2], [3, 4]]
    assert [list(r) for r in split_blocks(ParallelismConfig(pp_degree=2, pp_split=[1, 4]), 5)] == [[0], [1, 2, 3, 4]]

    def student() -> nn.ModuleDict:
        torch.manual_seed(0)
        head = {"hidden_dim": 32, "bottleneck_dim": 16}
        backbone = build_backbone("vit_test", **HUB_SETTINGS, depth=3)
        return nn.ModuleDict({"backbone": backbone, "dino_head": DINOHead(64, 32, **head),
                              "ibot_head": DINOHead(64, 32, **head)})  # fmt: skip

    whole = student()
    stages = [split_student(student(), p, r) for r in range(2)]
    keys = [set(s.state_dict()) for s in stages]
    assert keys[0] | keys[1] == set(whole.state_dict())
    assert keys[0] & keys[1] == {"backbone.rope_embed.periods"}  # the one constant buffer every stage needs
    assert all(torch.equal(whole.state_dict()[k], v) for s in stages for k, v in s.state_dict().items())
    owners = stage_owners([n for n, _ in whole.named_parameters()], p, 3)
    assert {n for n, r in owners.items() if r == 0} == {n for n, _ in stages[0].named_parameters()}
    assert {n for n, r in owners.items() if r == 1} == {n for n, _ in stages[1].named_parameters()}


@pytest.mark.slow
def test_pipeline_matches_unsplit_step() -> None:
    proc = torchrun(str(DIST_SCRIPTS / "pp_student.py"), timeout=300)
    assert "PP_STUDENT_OK" in proc.stdout, proc.stdout
    results = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith('{"rank"')]
    assert len(results) == 2 * 10
    for r in results:
        if r["scale"] == "right":
            assert r["max_param_diff"] < 1e-5 and r["max_grad_diff"] < 1e-5 and r["max_teacher_diff"] < 1e-5, r
        else:  # gradients n_mb × (unscaled, GA 1), n_mb × (scaled by GA only) or GA·n_mb × (unscaled) too large
            expected = r["n_mb"] * (r["ga"] if r["scale"] == "none" else 1)
            assert abs(r["grad_ratio"] - expected) < 1e-4, r
        if r["rank"] == 1:  # the last stage: its micro-batch losses saw exactly the unsplit Sinkhorn targets
            assert r["max_target_diff"] == 0.0 and r["per_microbatch_sinkhorn_kl"] > 1e-3, r
