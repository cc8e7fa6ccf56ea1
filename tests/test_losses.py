"""SSL losses: Sinkhorn-Knopp, DINO, iBOT, KoLeo, Gram against explicit hand computations, and the
gradient-accumulation contract (targets once per step, micro-batch losses ÷ n_micro sum to the full loss)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from dinov3_core.data.masking import IBOTMaskSampler
from dinov3_core.losses import (
    DINOLoss,
    GramLoss,
    KoLeoLoss,
    LossesConfig,
    SSLLossWeights,
    dino_pair_count,
    dino_teacher_targets,
    ibot_teacher_targets,
    iBOTPatchLoss,
    koleo_nearest_neighbours,
    resize_patch_tokens,
    sinkhorn_knopp,
)
from tests.helpers import DIST_SCRIPTS, torchrun


def reference_sinkhorn(logits: torch.Tensor, temp: float, n_iterations: int = 3) -> torch.Tensor:
    """Literal single-process transcription of upstream's sinkhorn_knopp_teacher, in float64."""
    q = torch.exp(logits.double() / temp).t()  # [K, N]
    n, k = q.shape[1], q.shape[0]
    q /= q.sum()
    for _ in range(n_iterations):
        q /= q.sum(dim=1, keepdim=True)
        q /= k
        q /= q.sum(dim=0, keepdim=True)
        q /= n
    q *= n
    return q.t()


# ------------------------------------------------------------------------------------------ Sinkhorn


@pytest.mark.parametrize("scale", [0.05, 0.5, 2.0])
def test_sinkhorn_equals_reference(scale: float) -> None:
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(24, 10, generator=gen, dtype=torch.float64) * scale
    for temp in (0.04, 0.07):
        for iters in (1, 3, 5):
            ours = sinkhorn_knopp(logits, temp, iters)
            assert ours.dtype == torch.float64
            torch.testing.assert_close(ours, reference_sinkhorn(logits, temp, iters), rtol=1e-10, atol=1e-12)
    # fp32 and bf16 inputs are computed in fp32.
    ours32 = sinkhorn_knopp(logits.float(), 0.07)
    assert ours32.dtype == torch.float32
    torch.testing.assert_close(ours32.double(), reference_sinkhorn(logits.float(), 0.07), rtol=1e-4, atol=1e-6)
    assert sinkhorn_knopp(logits.bfloat16(), 0.07).dtype == torch.float32


def test_sinkhorn_normalisation_properties() -> None:
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(40, 8, generator=gen, dtype=torch.float64)
    q = sinkhorn_knopp(logits, 0.1, n_iterations=3)
    assert (q >= 0).all()
    # The last step normalises samples: every sample's targets are a distribution.
    torch.testing.assert_close(q.sum(dim=1), torch.ones(40, dtype=torch.float64))
    # Prototype marginals approach the uniform N/K as iterations increase (Sinkhorn converges).
    errors = [(sinkhorn_knopp(logits, 0.1, it).sum(0) - 40 / 8).abs().max().item() for it in (3, 30, 300)]
    assert errors[0] > errors[1] > errors[2] and errors[2] < 1e-6
    with pytest.raises(ValueError):
        sinkhorn_knopp(logits, 0.1, n_iterations=0)


def test_sinkhorn_is_overflow_safe() -> None:
    """Upstream's exp(z/τ) overflows for z > 3.5 at τ = 0.04; ours stays exact where it can be compared."""
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(16, 12, generator=gen) * 10  # z/τ up to ~900
    q = sinkhorn_knopp(logits, 0.04)
    assert torch.isfinite(q).all()
    torch.testing.assert_close(q.sum(1), torch.ones(16))
    naive32 = torch.exp(logits / 0.04)
    assert torch.isinf(naive32).any()  # what upstream would have exponentiated
    # In float64 the literal reference does not overflow here, and we agree with it.
    torch.testing.assert_close(q.double(), reference_sinkhorn(logits.double(), 0.04), rtol=1e-4, atol=1e-6)


def test_sinkhorn_padding_rows() -> None:
    gen = torch.Generator().manual_seed(3)
    real = torch.randn(10, 6, generator=gen)
    padded = torch.cat([real, 1e4 * torch.randn(5, 6, generator=gen)])
    expected = sinkhorn_knopp(real, 0.07)
    for n_masked in (10, torch.tensor(10), torch.tensor([10])):
        out = ibot_teacher_targets(padded, 0.07, n_masked)
        torch.testing.assert_close(out[:10], expected)
        assert (out[10:] == 0).all()
    assert (sinkhorn_knopp(padded, 0.07, n_masked=0) == 0).all()


def test_dino_teacher_targets_is_joint_over_crops() -> None:
    gen = torch.Generator().manual_seed(4)
    logits = torch.randn(2, 6, 9, generator=gen)
    out = dino_teacher_targets(logits, 0.05)
    assert out.shape == logits.shape
    torch.testing.assert_close(out.reshape(12, 9), sinkhorn_knopp(logits.reshape(12, 9), 0.05))


def test_sinkhorn_allreduce_two_processes() -> None:
    """2 gloo ranks, each holding a slice, give the single-process result on the concatenated batch."""
    result = torchrun(str(DIST_SCRIPTS / "ssl_sinkhorn.py"), timeout=180)
    assert "SSL_SINKHORN_OK" in result.stdout


# ----------------------------------------------------------------------------------------------- DINO


def _explicit_dino(student: torch.Tensor, teacher: torch.Tensor, temp: float, ignore_diagonal: bool) -> float:
    total, count = 0.0, 0
    n_s, b, _ = student.shape
    for s in range(n_s):
        for t in range(teacher.shape[0]):
            if ignore_diagonal and s == t:
                continue
            for i in range(b):
                logits = student[s, i].double() / temp
                log_p = logits - math.log(float(torch.exp(logits).sum()))
                total += -float((teacher[t, i].double() * log_p).sum())
                count += 1
    return total / count


def test_dino_loss_matches_explicit_loops() -> None:
    gen = torch.Generator().manual_seed(5)
    teacher = dino_teacher_targets(torch.randn(2, 4, 7, generator=gen), 0.05)
    student_global = torch.randn(2, 4, 7, generator=gen)
    student_local = torch.randn(3, 4, 7, generator=gen)
    loss = DINOLoss(student_temp=0.1)
    got_global = loss(student_global, teacher, ignore_diagonal=True)
    got_local = loss(student_local, teacher)
    assert got_global.item() == pytest.approx(_explicit_dino(student_global, teacher, 0.1, True), rel=1e-5)
    assert got_local.item() == pytest.approx(_explicit_dino(student_local, teacher, 0.1, False), rel=1e-5)
    # With ignore_diagonal the normaliser is b·S_g·(S_g−1) = 2b for two crops.
    full = loss(student_global, teacher)
    assert full.item() == pytest.approx(_explicit_dino(student_global, teacher, 0.1, False), rel=1e-5)


@pytest.mark.parametrize(("n_student", "n_teacher"), [(4, 2), (2, 3), (1, 2)])
def test_dino_loss_ignores_the_diagonal_of_a_rectangular_crop_matrix(n_student: int, n_teacher: int) -> None:
    """Different student and teacher crop counts (e.g. 4 local student crops against 2 global teacher crops):
    pairs (i, i) for i < min(S_s, S_t) are left out and the normaliser counts the rest, as upstream does."""
    gen = torch.Generator().manual_seed(11)
    teacher = dino_teacher_targets(torch.randn(n_teacher, 3, 7, generator=gen), 0.05)
    student = torch.randn(n_student, 3, 7, generator=gen)
    got = DINOLoss(student_temp=0.1)(student, teacher, ignore_diagonal=True)
    assert got.item() == pytest.approx(_explicit_dino(student, teacher, 0.1, True), rel=1e-5)
    assert dino_pair_count(n_student, n_teacher, True) == n_student * n_teacher - min(n_student, n_teacher)


# ----------------------------------------------------------------------------------------------- iBOT


def test_ibot_loss_matches_explicit_loops() -> None:
    gen = torch.Generator().manual_seed(6)
    masks = torch.zeros(6, 9, dtype=torch.bool)  # 2 crops × 3 images, 9 patches
    masks[0, [1, 2, 5]] = True
    masks[3, [0]] = True
    masks[4, [0, 1, 2, 3, 4, 5, 6, 7]] = True
    index = masks.flatten().nonzero().flatten()
    student = torch.randn(len(index), 11, generator=gen)
    teacher = sinkhorn_knopp(torch.randn(len(index), 11, generator=gen), 0.07)
    weights = torch.cat([torch.full((int(m.sum()),), 1.0 / int(m.sum())) for m in masks if m.any()])

    expected = 0.0
    row = 0
    for crop in range(6):
        n_masked = int(masks[crop].sum())
        for _ in range(n_masked):
            log_p = F.log_softmax(student[row].double() / 0.1, dim=0)
            expected += -float((teacher[row].double() * log_p).sum()) / n_masked
            row += 1
    expected /= 6  # all crops, masked or not
    got = iBOTPatchLoss(student_temp=0.1)(student, teacher, weights, n_crops=6)
    assert got.item() == pytest.approx(expected, rel=1e-5)
    empty = iBOTPatchLoss()(student[:0], teacher[:0], weights[:0], n_crops=6)
    assert empty.item() == 0.0


# ---------------------------------------------------------------------------------------------- KoLeo


def _explicit_koleo(x: torch.Tensor) -> float:
    """x [S, B, D]: mean over crops of −mean_i log(min_j≠i ‖x̂_i − x̂_j‖ + 1e-8)."""
    total = 0.0
    for crop in x.double():
        unit = [v / v.norm() for v in crop]
        for i, vi in enumerate(unit):
            nearest = min(float((vi - vj).norm()) for j, vj in enumerate(unit) if j != i)
            total += -math.log(nearest + 1e-8)
    return total / (x.shape[0] * x.shape[1])


def test_koleo_matches_explicit_loops() -> None:
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(2, 9, 5, generator=gen)
    assert KoLeoLoss()(x).item() == pytest.approx(_explicit_koleo(x), rel=1e-5)
    assert KoLeoLoss()(x[0]).item() == pytest.approx(_explicit_koleo(x[:1]), rel=1e-5)
    nn = koleo_nearest_neighbours(x)
    assert nn.shape == (2, 9) and (nn != torch.arange(9)).all()


def test_dino_and_koleo_compute_in_fp32_under_cpu_autocast() -> None:
    """Their docstrings promise fp32: bf16 training (autocast) must not round the DINO cross-entropy's einsum or
    KoLeo's neighbour search to bf16."""
    gen = torch.Generator().manual_seed(3)
    logits, teacher = torch.randn(2, 8, 256, generator=gen), torch.randn(2, 8, 256, generator=gen).softmax(-1)
    features = torch.randn(2, 16, 32, generator=gen)
    want = DINOLoss(0.1)(logits, teacher), KoLeoLoss()(features), koleo_nearest_neighbours(features)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = DINOLoss(0.1)(logits, teacher), KoLeoLoss()(features), koleo_nearest_neighbours(features)
    assert got[0].dtype == got[1].dtype == torch.float32
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]) and torch.equal(got[2], want[2])


def test_koleo_microbatches_reproduce_full_batch_value_and_gradient() -> None:
    gen = torch.Generator().manual_seed(8)
    full = torch.randn(2, 12, 4, generator=gen, dtype=torch.float64, requires_grad=True)
    loss = KoLeoLoss()
    full_loss = loss(full)
    (full_grad,) = torch.autograd.grad(full_loss, full)

    n_micro, b = 4, 3
    x = full.detach().clone().requires_grad_(True)
    neighbours = koleo_nearest_neighbours(x.detach())
    total = 0.0
    for i in range(n_micro):
        part = loss(x[:, i * b : (i + 1) * b], step_features=x.detach(), neighbours=neighbours, offset=i * b)
        (part / n_micro).backward()
        total += part.item() / n_micro
    assert total == pytest.approx(full_loss.item(), abs=1e-10)
    torch.testing.assert_close(x.grad, full_grad, rtol=1e-9, atol=1e-12)
    # Without step features the neighbour set shrinks to the micro-batch: a different objective.
    shrunk = sum(loss(x[:, i * b : (i + 1) * b]).item() for i in range(n_micro)) / n_micro
    assert abs(shrunk - full_loss.item()) > 1e-3


# ----------------------------------------------------------------------------------------------- Gram


def _explicit_gram(student, teacher, img_level: bool, remove_neg: bool, teacher_only: bool) -> float:
    def unit_rows(t):
        return [[v / v.norm() for v in img] for img in t.double()]

    s_imgs, t_imgs = unit_rows(student), unit_rows(teacher)
    if not img_level:
        s_imgs, t_imgs = [[v for img in s_imgs for v in img]], [[v for img in t_imgs for v in img]]
    total, count = 0.0, 0
    for s_vecs, t_vecs in zip(s_imgs, t_imgs, strict=True):
        for i in range(len(s_vecs)):
            for j in range(len(s_vecs)):
                s_ij, t_ij = float(s_vecs[i] @ s_vecs[j]), float(t_vecs[i] @ t_vecs[j])
                if remove_neg:
                    s_ij, t_ij = max(s_ij, 0.0), max(t_ij, 0.0)
                elif teacher_only:  # upstream: target clamped first, so its "both negative" student mask is empty
                    t_ij = max(t_ij, 0.0)
                total += (s_ij - t_ij) ** 2
                count += 1
    return total / count


@pytest.mark.parametrize("img_level", [True, False])
@pytest.mark.parametrize(("remove_neg", "teacher_only"), [(False, False), (True, False), (False, True)])
def test_gram_loss_matches_explicit_loops(img_level: bool, remove_neg: bool, teacher_only: bool) -> None:
    gen = torch.Generator().manual_seed(9)
    student, teacher = torch.randn(3, 4, 5, generator=gen), torch.randn(3, 4, 5, generator=gen)
    loss = GramLoss(img_level=img_level, remove_neg=remove_neg, remove_only_teacher_neg=teacher_only)
    expected = _explicit_gram(student, teacher, img_level, remove_neg, teacher_only)
    assert loss(student, teacher).item() == pytest.approx(expected, rel=1e-5)
    if not img_level:  # pre-selected tokens as [N, D]
        assert loss(student.flatten(0, 1), teacher.flatten(0, 1)).item() == pytest.approx(expected, rel=1e-5)


def test_gram_variants_differ_and_validate() -> None:
    gen = torch.Generator().manual_seed(10)
    student, teacher = torch.randn(2, 9, 6, generator=gen), torch.randn(2, 9, 6, generator=gen)
    values = {
        GramLoss(img_level=True)(student, teacher).item(),
        GramLoss(img_level=False)(student, teacher).item(),
        GramLoss(remove_neg=True)(student, teacher).item(),
        GramLoss(remove_only_teacher_neg=True)(student, teacher).item(),
    }
    assert len(values) == 4
    assert GramLoss()(teacher, teacher).item() == pytest.approx(0.0, abs=1e-7)
    with pytest.raises(ValueError):
        GramLoss(remove_neg=True, remove_only_teacher_neg=True)
    with pytest.raises(ValueError):
        GramLoss(img_level=True)(student.flatten(0, 1), teacher.flatten(0, 1))


def test_gram_high_resolution_teacher_is_resized_before_normalisation() -> None:
    gen = torch.Generator().manual_seed(11)
    student = torch.randn(2, 16, 8, generator=gen)  # 4×4 grid
    teacher_hr = torch.randn(2, 64, 8, generator=gen)  # 8×8 grid
    # Independent resize: tokens → [B, D, 8, 8] → bicubic, no antialias → [B, 16, D].
    grid = teacher_hr.permute(0, 2, 1).reshape(2, 8, 8, 8)
    manual = F.interpolate(grid, size=(4, 4), mode="bicubic", align_corners=False, antialias=False)
    manual = manual.reshape(2, 8, 16).permute(0, 2, 1)
    torch.testing.assert_close(resize_patch_tokens(teacher_hr, (8, 8), (4, 4)), manual)
    loss = GramLoss()
    assert loss(student, teacher_hr).item() == pytest.approx(loss(student, manual).item(), rel=1e-6)
    # Normalising before the resize would be a different (wrong) order.
    pre_normalised = resize_patch_tokens(F.normalize(teacher_hr, dim=-1), (8, 8), (4, 4))
    assert loss(student, teacher_hr).item() != pytest.approx(
        _explicit_gram(student, pre_normalised, True, False, False), rel=1e-6
    )
    with pytest.raises(ValueError):
        loss(student, torch.randn(2, 60, 8))


# ------------------------------------------------------------------------------ weights, accumulation


def test_loss_weights_defaults_and_generalisation() -> None:
    w = SSLLossWeights(LossesConfig(), n_global_crops=2, n_local_crops=8)
    assert (w.losses.dino_weight, w.losses.koleo_weight, w.losses.ibot_weight) == (1.0, 0.1, 1.0)
    assert w.dino_global_scale == pytest.approx(2 / 18) and w.dino_local_scale == pytest.approx(16 / 18)
    assert w.koleo_scale == 2.0
    w4 = SSLLossWeights(LossesConfig(), n_global_crops=4, n_local_crops=6)
    assert w4.dino_global_terms == 12 and w4.dino_local_terms == 24
    assert w4.dino_global_scale == pytest.approx(12 / 36)
    one = torch.tensor(1.0)
    total = w.total(dino_global=one, dino_local=one, koleo=one, ibot=one, gram=one, gram_weight=2.0)
    assert total.item() == pytest.approx(1.0 + 0.1 * 2 + 1.0 + 2.0)
    assert w.total(dino_global=one, dino_local=one, koleo=0.0, ibot=0.0, dino_local_weight=0.5).item() == (
        pytest.approx(2 / 18 + 0.5 * 16 / 18)
    )
    halved = SSLLossWeights(LossesConfig(local_loss_weight=0.5), n_global_crops=2, n_local_crops=8)
    assert halved.total(dino_global=one, dino_local=one, koleo=0.0, ibot=0.0).item() == pytest.approx(
        2 / 18 + 0.5 * 16 / 18
    )
    with pytest.raises(ValueError, match="gram_weight"):
        w.total(dino_global=one, dino_local=one, koleo=one, ibot=one, gram=one)


def test_gradient_accumulation_reproduces_full_batch_loss() -> None:
    """Targets once over the step batch, sliced per micro-batch; Σ micro-loss/n_micro == full loss (1e-6),
    and the gradients agree too."""
    gen = torch.Generator().manual_seed(12)
    n_g, n_l, batch, n_micro, k, d, grid = 2, 3, 8, 4, 16, 6, 3
    n_patches = grid * grid
    head = torch.randn(d, k, generator=gen, dtype=torch.float64) * 0.5
    g_feat = torch.randn(n_g, batch, d, generator=gen, dtype=torch.float64)
    l_feat = torch.randn(n_l, batch, d, generator=gen, dtype=torch.float64)
    p_feat = torch.randn(n_g, batch, n_patches, d, generator=gen, dtype=torch.float64)
    gram_teacher = torch.randn(n_g, batch, n_patches, d, generator=gen, dtype=torch.float64)
    teacher_cls = torch.randn(n_g, batch, k, generator=gen, dtype=torch.float64)
    teacher_patch = torch.randn(n_g * batch * n_patches, k, generator=gen, dtype=torch.float64)
    masks = IBOTMaskSampler(grid, mask_probability=0.75)(batch, n_g, rng=0)

    weights = SSLLossWeights(LossesConfig(), n_global_crops=n_g, n_local_crops=n_l)
    dino, ibot, koleo, gram = DINOLoss(), iBOTPatchLoss(), KoLeoLoss(), GramLoss()
    dino_t = dino_teacher_targets(teacher_cls, 0.06)
    ibot_t = ibot_teacher_targets(teacher_patch[masks.mask_indices], 0.06)
    step_neighbours = koleo_nearest_neighbours(g_feat)

    def step_loss(w, g, lo, p, gt, m, d_t, i_t, offset):
        b = g.shape[1]
        masked = (p.reshape(-1, d) @ w)[m.mask_indices]
        return weights.total(
            dino_global=dino(g @ w, d_t, ignore_diagonal=True),
            dino_local=dino(lo @ w, d_t),
            koleo=koleo(g, step_features=g_feat, neighbours=step_neighbours, offset=offset),
            ibot=ibot(masked, i_t, m.masks_weight.double(), m.n_crops),
            gram=gram((p @ w).flatten(0, 1), (gt @ w).flatten(0, 1)),
            gram_weight=0.7,
        ), b

    w_full = head.clone().requires_grad_(True)
    g_full = g_feat.clone().requires_grad_(True)
    full, _ = step_loss(w_full, g_full, l_feat, p_feat, gram_teacher, masks, dino_t, ibot_t, 0)
    full.backward()

    w_acc = head.clone().requires_grad_(True)
    g_acc = g_feat.clone().requires_grad_(True)
    b = batch // n_micro
    total = 0.0
    for i in range(n_micro):
        rows = slice(i * b, (i + 1) * b)
        micro_masks, positions = masks.microbatch(i, n_micro)
        loss, _ = step_loss(
            w_acc,
            g_acc[:, rows],
            l_feat[:, rows],
            p_feat[:, rows],
            gram_teacher[:, rows],
            micro_masks,
            dino_t[:, rows],
            ibot_t[positions],
            i * b,
        )
        (loss / n_micro).backward()
        total += loss.item() / n_micro
    assert total == pytest.approx(full.item(), abs=1e-6)
    torch.testing.assert_close(w_acc.grad, w_full.grad, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(g_acc.grad, g_full.grad, rtol=1e-9, atol=1e-9)

    # Counter-check: Sinkhorn per micro-batch instead of per step changes the objective
    # (docs/reference/distributed.md#sinkhorn-per-step).
    drift = (
        sum(
            dino(
                g_feat[:, i * b : (i + 1) * b] @ head,
                dino_teacher_targets(teacher_cls[:, i * b : (i + 1) * b], 0.06),
            ).item()
            for i in range(n_micro)
        )
        / n_micro
    )
    assert abs(drift - dino(g_feat @ head, dino_t).item()) > 1e-4
