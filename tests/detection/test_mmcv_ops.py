"""mmcv's op interface on torchvision's kernels, checked through mmcv's own Python ops.

References: mmcv's RoIAlign test values (tests/test_ops/test_roi_align.py), a brute-force
bilinear RoIAlign written from the algorithm's definition, gradcheck in float64, and brute-force
greedy NMS. Import-order cases run in fresh interpreters.
"""
from __future__ import annotations

import math
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

import polyattn_lightning.detection  # noqa: F401  (installs mmcv._ext before mmcv.ops is imported)
from mmcv.ops import RoIAlign, batched_nms, nms, nms_match, roi_align, soft_nms
from polyattn_lightning.detection import MMCVOpUnavailable

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])

# mmcv's reference cases: aligned=True, pool 2x2, spatial_scale 1, sampling_ratio 2
MMCV_CASES = [
    ([[[[1.0, 2.0], [3.0, 4.0]]]], [[0.0, 0.0, 0.0, 1.0, 1.0]],
     [[[[1.0, 1.25], [1.5, 1.75]]]], [[[[3.0625, 0.4375], [0.4375, 0.0625]]]]),
    ([[[[1.0, 2.0], [3.0, 4.0]], [[4.0, 3.0], [2.0, 1.0]]]], [[0.0, 0.0, 0.0, 1.0, 1.0]],
     [[[[1.0, 1.25], [1.5, 1.75]], [[4.0, 3.75], [3.5, 3.25]]]],
     [[[[3.0625, 0.4375], [0.4375, 0.0625]], [[3.0625, 0.4375], [0.4375, 0.0625]]]]),
    ([[[[1.0, 2.0, 5.0, 6.0], [3.0, 4.0, 7.0, 8.0], [9.0, 10.0, 13.0, 14.0], [11.0, 12.0, 15.0, 16.0]]]],
     [[0.0, 0.0, 0.0, 3.0, 3.0]],
     [[[[1.9375, 4.75], [7.5625, 10.375]]]],
     [[[[0.47265625, 0.4296875, 0.4296875, 0.04296875], [0.4296875, 0.390625, 0.390625, 0.0390625],
        [0.4296875, 0.390625, 0.390625, 0.0390625], [0.04296875, 0.0390625, 0.0390625, 0.00390625]]]]),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16])
@pytest.mark.parametrize("case", range(len(MMCV_CASES)))
def test_roi_align_matches_mmcv_reference_values(case, dtype, device):
    feats, rois, expected_out, expected_grad = MMCV_CASES[case]
    x = torch.tensor(feats, dtype=dtype, device=device, requires_grad=True)
    out = roi_align(x, torch.tensor(rois, dtype=dtype, device=device), (2, 2), 1.0, 2, "avg", True)
    out.backward(torch.ones_like(out))
    assert out.dtype == dtype and x.grad.dtype == dtype
    torch.testing.assert_close(out.float().cpu(), torch.tensor(expected_out), atol=1e-3, rtol=0)
    torch.testing.assert_close(x.grad.float().cpu(), torch.tensor(expected_grad), atol=1e-3, rtol=0)


def _bilinear(img: np.ndarray, y: float, x: float) -> np.ndarray:
    """Detectron/caffe2 RoIAlign sampling of ``img`` (C, H, W): zero outside [-1, H] x [-1, W], edge-clamped."""
    _, height, width = img.shape
    if y < -1.0 or y > height or x < -1.0 or x > width:
        return np.zeros(img.shape[0])
    y, x = min(max(y, 0.0), height - 1), min(max(x, 0.0), width - 1)
    y0, x0 = int(math.floor(y)), int(math.floor(x))
    y1, x1 = min(y0 + 1, height - 1), min(x0 + 1, width - 1)
    ly, lx = y - y0, x - x0
    return ((1 - ly) * (1 - lx) * img[:, y0, x0] + (1 - ly) * lx * img[:, y0, x1]
            + ly * (1 - lx) * img[:, y1, x0] + ly * lx * img[:, y1, x1])


def _roi_align_reference(feats, rois, out_hw, scale, sampling_ratio, aligned):
    """RoIAlign (average) from its definition: each bin averages a grid of bilinear samples."""
    ph, pw = out_hw
    out = np.zeros((len(rois), feats.shape[1], ph, pw))
    for r, (b, x1, y1, x2, y2) in enumerate(rois):
        offset = 0.5 if aligned else 0.0
        sx, sy = x1 * scale - offset, y1 * scale - offset
        w, h = x2 * scale - offset - sx, y2 * scale - offset - sy
        if not aligned:
            w, h = max(w, 1.0), max(h, 1.0)
        bh, bw = h / ph, w / pw
        gh = sampling_ratio if sampling_ratio > 0 else math.ceil(h / ph)
        gw = sampling_ratio if sampling_ratio > 0 else math.ceil(w / pw)
        for i in range(ph):
            for j in range(pw):
                acc = np.zeros(feats.shape[1])
                for iy in range(gh):
                    for ix in range(gw):
                        y = sy + i * bh + (iy + 0.5) * bh / gh
                        x = sx + j * bw + (ix + 0.5) * bw / gw
                        acc += _bilinear(feats[int(b)], y, x)
                out[r, :, i, j] = acc / max(gh * gw, 1)
    return out


def _random_rois(gen: torch.Generator, n: int, batch: int, extent: float) -> torch.Tensor:
    corners = torch.rand(n, 2, 2, generator=gen, dtype=torch.float64) * extent - 2.0  # some reach past the edges
    lo, hi = corners.min(dim=1).values, corners.max(dim=1).values
    index = torch.randint(0, batch, (n, 1), generator=gen).double()
    return torch.cat([index, lo, hi], dim=1)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "scale, sampling_ratio, aligned", [(1.0, 2, True), (0.5, 0, True), (0.25, 3, False), (0.5, 0, False)]
)
def test_roi_align_matches_brute_force_definition(scale, sampling_ratio, aligned, device):
    gen = torch.Generator().manual_seed(0)
    feats = torch.randn(2, 3, 7, 9, generator=gen, dtype=torch.float64)
    rois = _random_rois(gen, 6, 2, extent=12.0 / scale)
    module = RoIAlign((3, 2), spatial_scale=scale, sampling_ratio=sampling_ratio, aligned=aligned)
    out = module(feats.to(device), rois.to(device)).cpu()
    expected = _roi_align_reference(feats.numpy(), rois.numpy(), (3, 2), scale, sampling_ratio, aligned)
    np.testing.assert_allclose(out.numpy(), expected, atol=1e-10)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("sampling_ratio, aligned", [(2, True), (0, True), (2, False)])
def test_roi_align_gradcheck_float64(sampling_ratio, aligned, device):
    gen = torch.Generator().manual_seed(1)
    feats = torch.randn(2, 2, 6, 5, generator=gen, dtype=torch.float64).to(device).requires_grad_()
    rois = _random_rois(gen, 4, 2, extent=8.0).to(device)
    module = RoIAlign((2, 3), spatial_scale=0.5, sampling_ratio=sampling_ratio, aligned=aligned)
    assert torch.autograd.gradcheck(lambda f: module(f, rois), (feats,), eps=1e-6, atol=1e-6)


def _iou(a: np.ndarray, b: np.ndarray, offset: int) -> float:
    w = max(0.0, min(a[2], b[2]) - max(a[0], b[0]) + offset)
    h = max(0.0, min(a[3], b[3]) - max(a[1], b[1]) + offset)
    inter = w * h
    area = lambda box: (box[2] - box[0] + offset) * (box[3] - box[1] + offset)  # noqa: E731
    return inter / (area(a) + area(b) - inter)


def _nms_brute_force(boxes: np.ndarray, scores: np.ndarray, thr: float, offset: int = 0) -> list[int]:
    """Greedy NMS: visit boxes by descending score, keep one that overlaps no kept box by more than ``thr``."""
    kept: list[int] = []
    for i in np.argsort(-scores, kind="stable"):
        if all(_iou(boxes[i], boxes[k], offset) <= thr for k in kept):
            kept.append(int(i))
    return kept


def _random_boxes(seed: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    xy = torch.rand(n, 2, generator=gen) * 40
    wh = torch.rand(n, 2, generator=gen) * 15 + 1
    scores = torch.randperm(n, generator=gen).float() / n + 0.01  # distinct: the order is defined
    return torch.cat([xy, xy + wh], dim=1), scores


def test_nms_matches_mmcv_reference_values():
    boxes = torch.tensor([[6.0, 3.0, 8.0, 7.0], [3.0, 6.0, 9.0, 11.0], [3.0, 7.0, 10.0, 12.0], [1.0, 4.0, 13.0, 7.0]])
    scores = torch.tensor([0.6, 0.9, 0.7, 0.2])
    dets, inds = nms(boxes, scores, iou_threshold=0.3, offset=0)
    assert inds.tolist() == [1, 0, 3]
    torch.testing.assert_close(dets, torch.tensor(
        [[3.0, 6.0, 9.0, 11.0, 0.9], [6.0, 3.0, 8.0, 7.0, 0.6], [1.0, 4.0, 13.0, 7.0, 0.2]]))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("thr, offset", [(0.3, 0), (0.5, 0), (0.7, 0), (0.5, 1)])
def test_nms_matches_brute_force(thr, offset, device):
    for seed in range(3):
        boxes, scores = _random_boxes(seed, 60)
        dets, inds = nms(boxes.to(device), scores.to(device), iou_threshold=thr, offset=offset)
        assert inds.dtype == torch.int64
        assert inds.cpu().tolist() == _nms_brute_force(boxes.numpy(), scores.numpy(), thr, offset)
        torch.testing.assert_close(dets.cpu(), torch.cat([boxes, scores[:, None]], 1)[inds.cpu()])


def test_nms_score_threshold_max_num_and_numpy_input():
    boxes, scores = _random_boxes(5, 50)
    _, inds = nms(boxes.numpy(), scores.numpy(), iou_threshold=0.5, score_threshold=0.4, max_num=5)
    above = np.flatnonzero(scores.numpy() > 0.4)
    expected = above[_nms_brute_force(boxes.numpy()[above], scores.numpy()[above], 0.5)][:5]
    assert isinstance(inds, np.ndarray) and inds.tolist() == expected.tolist()
    dets, inds = nms(boxes[:0], scores[:0], iou_threshold=0.5)
    assert dets.shape == (0, 5) and inds.numel() == 0


@pytest.mark.parametrize("split_thr", [10000, 10])  # 10: the per-class loop mmcv takes for many boxes
def test_batched_nms_matches_per_class_brute_force(split_thr):
    boxes, scores = _random_boxes(7, 80)
    labels = torch.randint(0, 4, (80,), generator=torch.Generator().manual_seed(7))
    dets, keep = batched_nms(boxes, scores, labels, dict(type="nms", iou_threshold=0.5, split_thr=split_thr))
    expected = []
    for c in range(4):
        members = np.flatnonzero(labels.numpy() == c)
        expected += members[_nms_brute_force(boxes.numpy()[members], scores.numpy()[members], 0.5)].tolist()
    expected.sort(key=lambda i: -scores[i].item())
    assert keep.tolist() == expected
    torch.testing.assert_close(dets, torch.cat([boxes, scores[:, None]], 1)[keep])
    _, agnostic = batched_nms(boxes, scores, labels, dict(type="nms", iou_threshold=0.5, class_agnostic=True))
    assert agnostic.tolist() == _nms_brute_force(boxes.numpy(), scores.numpy(), 0.5)


def test_ops_without_a_torchvision_kernel_name_themselves():
    boxes, scores = _random_boxes(0, 4)
    with pytest.raises(MMCVOpUnavailable, match=r"mmcv op 'softnms' needs a compiled mmcv"):
        soft_nms(boxes, scores)
    with pytest.raises(MMCVOpUnavailable, match=r"'nms_match' needs a compiled mmcv"):
        nms_match(torch.cat([boxes, scores[:, None]], 1), 0.5)
    with pytest.raises(MMCVOpUnavailable, match=r"'roi_align_forward' with pool_mode='max'"):
        roi_align(torch.ones(1, 1, 4, 4), torch.tensor([[0.0, 0, 0, 2, 2]]), 2, 1.0, 0, "max", True)
    from mmcv.ops import DeformConv2d

    with pytest.raises(MMCVOpUnavailable, match=r"'deform_conv_forward' needs a compiled mmcv"):
        DeformConv2d(2, 2, 3, padding=1)(torch.ones(1, 2, 5, 5), torch.zeros(1, 18, 5, 5))


def _run_fresh(code: str, tmp_path) -> str:
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=600,
        cwd=tmp_path, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


@pytest.mark.slow  # fresh interpreters, each importing mmdet
def test_import_after_a_failed_mmdet_import_and_after_stubs_were_bound(tmp_path):
    out = _run_fresh(
        """
        import sys, types, torch
        try:
            import mmdet.models
        except ModuleNotFoundError as error:
            assert error.name == "mmcv._ext", error
        else:
            raise AssertionError("mmdet.models imported without mmcv._ext: the test premise is gone")
        import polyattn_lightning.detection
        import mmdet.models
        from mmcv.ops import roi_align
        x = torch.tensor([[[[1.0, 2.0], [3.0, 4.0]]]])
        print(roi_align(x, torch.tensor([[0.0, 0, 0, 1, 1]]), 2, 1.0, 2, "avg", True).flatten().tolist())
        """,
        tmp_path,
    )
    assert out.strip() == "[1.0, 1.25, 1.5, 1.75]"
    out = _run_fresh(
        """
        import sys, types, torch
        stub = types.ModuleType("mmcv._ext")  # someone else's stand-in, bound by mmcv.ops at import
        def stub_op(name):
            if name.startswith("__"):
                raise AttributeError(name)
            return lambda *args, **kwargs: "stub"
        stub.__getattr__ = stub_op
        sys.modules["mmcv._ext"] = stub
        import mmcv.ops
        import polyattn_lightning.detection
        print(mmcv.ops.nms(torch.tensor([[0.0, 0, 2, 2], [0.0, 0, 2, 2.1]]), torch.tensor([0.5, 0.9]), 0.5)[1].tolist())
        """,
        tmp_path,
    )
    assert out.strip() == "[1]"


@pytest.mark.slow  # fresh interpreters, each importing mmdet
def test_an_importable_mmcv_ext_takes_precedence(tmp_path):
    (tmp_path / "mmcv_ext_dir").mkdir()
    (tmp_path / "mmcv_ext_dir" / "_ext.py").write_text(textwrap.dedent(
        """
        COMPILED = True
        def __getattr__(name):  # a compiled mmcv has every op mmcv.ops asks for at import
            if name.startswith("__"):
                raise AttributeError(name)
            return lambda *args, **kwargs: None
        """
    ))
    out = _run_fresh(
        f"""
        import sys, mmcv
        mmcv.__path__.append({str(tmp_path / "mmcv_ext_dir")!r})  # stands in for a compiled mmcv/_ext*.so
        import polyattn_lightning.detection
        from polyattn_lightning.detection import install
        print(getattr(sys.modules["mmcv._ext"], "COMPILED", False), install())
        """,
        tmp_path,
    )
    assert out.strip() == "True False"


def test_an_mmcv_that_calls_its_ops_otherwise_is_refused_in_one_line(monkeypatch):
    """The stand-in answers the calls of the reviewed mmcv releases (mmcv_ops.MIRROR): an NMS op whose forward
    changed is refused when the stand-in is installed, naming mmcv and what to do."""
    from importlib.metadata import version

    from mmcv.ops.nms import NMSop

    from polyattn_lightning.detection.mmcv_ops import install
    from polyattn_lightning.errors import ConfigError

    reviewed = NMSop.forward

    def forward(ctx, bboxes, scores, iou_threshold, offset, score_threshold, max_num):
        return reviewed(ctx, bboxes, scores, iou_threshold, offset, score_threshold, max_num)

    monkeypatch.setattr(NMSop, "forward", staticmethod(forward))
    with pytest.raises(ConfigError) as refused:
        install()
    assert str(refused.value) == (
        f"mmcv-lite {version('mmcv-lite')}'s mmcv._ext differs from the code polyattn_lightning was reviewed against: "
        "pin a reviewed release (mmcv-lite==2.1.0; reviewed: 2.0.0, 2.1.0), or upgrade polyattn_lightning"
    )
    monkeypatch.undo()
    assert install()
