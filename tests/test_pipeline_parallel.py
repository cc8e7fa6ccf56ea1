"""PROTOTYPE (issue 14): pipeline parallelism of the student, 2 gloo processes = 2 stages, equals the unsplit step."""

from __future__ import annotations

import json

import pytest

from tests.helpers import DIST_SCRIPTS, torchrun


def test_contract_rejects_bad_microbatching() -> None:
    from dinov3_core.train.pipeline_parallel import PPContractError, check_pp_contract

    assert check_pp_contract(local_batch=8, microbatch_size=2, pp_degree=2, schedule="1F1B", depth=12) == 4
    assert check_pp_contract(local_batch=2, microbatch_size=2, pp_degree=2, schedule="GPipe", depth=12) == 1
    with pytest.raises(PPContractError, match="must divide"):
        check_pp_contract(local_batch=8, microbatch_size=3, pp_degree=2, schedule="1F1B", depth=12)
    with pytest.raises(PPContractError, match="< 4 stages"):
        check_pp_contract(local_batch=4, microbatch_size=2, pp_degree=4, schedule="1F1B", depth=12)
    with pytest.raises(PPContractError, match="pp_schedule"):
        check_pp_contract(local_batch=4, microbatch_size=2, pp_degree=2, schedule="nope", depth=12)


def test_split_keeps_fqns() -> None:
    import torch
    from torch import nn

    from dinov3_core.models import HUB_SETTINGS, DINOHead, build_backbone
    from dinov3_core.train.pipeline_parallel import build_stage, split_blocks, stage_owners

    assert [list(r) for r in split_blocks(5, 2)] == [[0, 1, 2], [3, 4]]
    torch.manual_seed(0)
    bb = build_backbone("vit_test", **HUB_SETTINGS, depth=3)
    student = nn.ModuleDict({"backbone": bb, "dino_head": DINOHead(64, 32, hidden_dim=32, bottleneck_dim=16),
                             "ibot_head": DINOHead(64, 32, hidden_dim=32, bottleneck_dim=16)})  # fmt: skip
    stages = [build_stage(student, r, 2) for r in range(2)]
    keys = [set(s.state_dict()) for s in stages]
    assert keys[0] | keys[1] == set(student.state_dict())
    assert keys[0] & keys[1] == {"backbone.rope_embed.periods"}  # the one constant buffer every stage needs
    owners = stage_owners(student, 2)
    assert {n for n, r in owners.items() if r == 0} == {n for n, _ in stages[0].named_parameters()}


@pytest.mark.slow
def test_pipeline_matches_unsplit_step() -> None:
    proc = torchrun(str(DIST_SCRIPTS / "pp_student.py"), timeout=300)
    assert "PP_STUDENT_OK" in proc.stdout, proc.stdout
    results = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith('{"rank"')]
    assert len(results) == 2 * 8
    for r in results:
        if r["scaled"]:
            assert r["max_param_diff"] < 1e-5 and r["max_grad_diff"] < 1e-5 and r["max_teacher_diff"] < 1e-5, r
        else:
            assert abs(r["grad_ratio"] - r["n_mb"] * r["ga"]) < 1e-4, r
