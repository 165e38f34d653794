"""mmcv's compiled-op module ``mmcv._ext``, implemented with torchvision's kernels.

mmdet 3.3 requires mmcv < 2.2; mmcv 2.1 does not compile against torch >= 2.10 (its build forces
C++17, torch's headers need C++20) and mmcv-lite ships no ``mmcv._ext``. mmcv's Python ops reach
their kernels by name through ``mmcv.utils.ext_loader.load_ext('_ext', names)``, which only checks
that the names exist. So a module providing the functions Mask R-CNN calls (RoIAlign forward and
backward, NMS), with mmcv's signatures and in-place output conventions, makes mmdet's own models
run unchanged on CPU and CUDA. Every other name resolves to a function that raises
:class:`MMCVOpUnavailable` naming the op.

A compiled mmcv that imports takes precedence: :func:`install` then changes nothing. The stand-in answers the calls
of mmcv's ``RoIAlignFunction`` and ``NMSop`` as the reviewed mmcv releases make them (:data:`MIRROR`,
``attention/switch/reviewed.py``): with another release's calls :func:`install` refuses in one line.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import sys
import types
import warnings
from collections.abc import Callable

import torch
import torchvision  # noqa: F401  (registers torch.ops.torchvision)
from torch import Tensor
from torchvision.ops import nms as _tv_nms

from ..attention.switch.reviewed import Mirror

EXT_NAME = "mmcv._ext"
#: The mmcv code whose calls the stand-in answers (the signatures and in-place conventions below).
MIRROR = Mirror(
    "mmcv-lite",
    EXT_NAME,
    (
        "mmcv.ops.roi_align.RoIAlignFunction.forward",
        "mmcv.ops.roi_align.RoIAlignFunction.backward",
        "mmcv.ops.nms.NMSop.forward",
    ),
)


class MMCVOpUnavailable(NotImplementedError):
    """An mmcv op that only a compiled mmcv provides was called."""


def _unavailable(op: str, detail: str = "") -> MMCVOpUnavailable:
    return MMCVOpUnavailable(
        f"mmcv op '{op}'{detail} needs a compiled mmcv (mmcv._ext); this environment has "
        f"polyattn_lightning's torchvision-backed stand-in, which provides only {', '.join(PROVIDED)}"
    )


def _kernel_dtype(t: Tensor) -> Tensor:
    """torchvision's CPU kernels take float32/float64 only: compute half/bf16 in float32."""
    return t if t.dtype in (torch.float32, torch.float64) else t.float()


def roi_align_forward(
    input: Tensor,
    rois: Tensor,
    output: Tensor,
    argmax_y: Tensor,
    argmax_x: Tensor,
    aligned_height: int,
    aligned_width: int,
    spatial_scale: float,
    sampling_ratio: int,
    pool_mode: int,
    aligned: bool,
) -> None:
    """mmcv's ``roi_align_forward``: fills ``output`` (K, C, aligned_height, aligned_width) in place.

    ``rois`` are (K, 5) ``(batch_index, x1, y1, x2, y2)``; ``pool_mode`` 1 is average (the only
    mode torchvision has; mmdet's RoI extractors and mask targets use it).
    """
    if pool_mode != 1:
        raise _unavailable("roi_align_forward", " with pool_mode='max'")
    x = _kernel_dtype(input)
    out = torch.ops.torchvision.roi_align(
        x,
        rois.to(x.dtype),
        float(spatial_scale),
        int(aligned_height),
        int(aligned_width),
        int(sampling_ratio),
        bool(aligned),
    )
    output.copy_(out)


def roi_align_backward(
    grad_output: Tensor,
    rois: Tensor,
    argmax_y: Tensor,
    argmax_x: Tensor,
    grad_input: Tensor,
    aligned_height: int,
    aligned_width: int,
    spatial_scale: float,
    sampling_ratio: int,
    pool_mode: int,
    aligned: bool,
) -> None:
    """mmcv's ``roi_align_backward``: fills ``grad_input`` (the input's shape) in place."""
    if pool_mode != 1:
        raise _unavailable("roi_align_backward", " with pool_mode='max'")
    g = _kernel_dtype(grad_output)
    batch, channels, height, width = grad_input.shape
    grad = torch.ops.torchvision._roi_align_backward(
        g,
        rois.to(g.dtype),
        float(spatial_scale),
        int(aligned_height),
        int(aligned_width),
        batch,
        channels,
        height,
        width,
        int(sampling_ratio),
        bool(aligned),
    )
    grad_input.copy_(grad)


def nms(boxes: Tensor, scores: Tensor, iou_threshold: float, offset: int = 0) -> Tensor:
    """mmcv's ``nms``: indices of the kept boxes (int64), highest score first.

    ``offset`` 1 is mmcv's legacy box size ``x2 - x1 + 1``; adding 1 to x2 and y2 gives torchvision
    the same intersections and areas.
    """
    boxes = _kernel_dtype(boxes)
    if offset:
        boxes = torch.cat([boxes[:, :2], boxes[:, 2:] + offset], dim=1)
    return _tv_nms(boxes, scores.to(boxes.dtype), float(iou_threshold))


#: The ops this module implements; every other name raises MMCVOpUnavailable when called.
PROVIDED: dict[str, Callable] = {
    "roi_align_forward": roi_align_forward,
    "roi_align_backward": roi_align_backward,
    "nms": nms,
}


def _missing_op(name: str) -> Callable:
    def op(*args, **kwargs):
        raise _unavailable(name)

    op.__name__ = op.__qualname__ = name
    return op


class TorchvisionExt(types.ModuleType):
    """The ``mmcv._ext`` stand-in: the ops in :data:`PROVIDED`; any other op name raises when called."""

    def __init__(self) -> None:
        super().__init__(EXT_NAME, "mmcv's compiled-op interface on torchvision's kernels (polyattn_lightning)")
        # no loader: mmengine's mmcv_full_available() stays False, as it should without a compiled mmcv
        self.__spec__ = importlib.machinery.ModuleSpec(EXT_NAME, None)
        self.__dict__.update(PROVIDED)

    def __getattr__(self, name: str) -> Callable:
        # load_ext asserts hasattr(ext, name) when mmcv.ops is imported: every op name must exist
        if name.startswith("__"):
            raise AttributeError(name)
        return _missing_op(name)


def _is_real(module: types.ModuleType) -> bool:
    """An imported ``mmcv._ext`` (compiled: ``_ext*.so``) has a file; a stand-in put into sys.modules has none."""
    path = getattr(module, "__file__", None)
    return isinstance(path, str) and bool(path)


def install() -> bool:
    """Make ``mmcv._ext`` the torchvision-backed module unless a compiled mmcv is importable.

    Returns True when the stand-in serves, False when a compiled mmcv does. Safe to call again and
    after ``mmcv.ops`` was imported: a failed ``import mmcv.ops`` left nothing bound, and ops
    modules that bound another stand-in get this one. Raises
    :class:`~polyattn_lightning.attention.switch.reviewed.UnreviewedCode` when the installed mmcv calls its ops
    otherwise than the reviewed releases (:data:`MIRROR`).
    """
    current = sys.modules.get(EXT_NAME)
    if isinstance(current, TorchvisionExt):
        module = current
    elif current is not None and _is_real(current):
        return False
    else:
        if current is None:
            try:
                importlib.import_module(EXT_NAME)
                return False
            except ModuleNotFoundError as error:
                if error.name != EXT_NAME:  # mmcv itself is missing: that needs the detection extra
                    raise ModuleNotFoundError(
                        f"{error}; detection needs mmdet and mmcv: pip install 'polyattn-lightning[detection]'",
                        name=error.name,
                    ) from error
            except ImportError as error:  # a compiled mmcv that does not load (ABI mismatch)
                warnings.warn(f"mmcv._ext failed to load ({error}); using torchvision's RoIAlign and NMS instead")
        module = TorchvisionExt()
        sys.modules[EXT_NAME] = module
    import mmcv

    mmcv._ext = module
    for name, loaded in list(sys.modules.items()):
        if name.startswith("mmcv.ops.") and hasattr(loaded, "ext_module"):
            loaded.ext_module = module
    MIRROR.route()
    return True


__all__ = [
    "MIRROR",
    "MMCVOpUnavailable",
    "PROVIDED",
    "TorchvisionExt",
    "install",
    "nms",
    "roi_align_backward",
    "roi_align_forward",
]
