"""The fingerprints of the library code the switches mirror, in the installed releases: listed, or recorded.

``python -m polyattn_lightning.bench fingerprints`` prints one line per mirrored class (library, installed
release, class, fingerprint, its recorded route or ``NOT REVIEWED``) and exits 1 when any is not recorded in
``attention/switch/reviewed.json`` (``attention/switch/reviewed.py``). Reviewing a new release of transformers,
timm, torch or mmcv: install it, run this, read each class marked ``NOT REVIEWED`` against its adapter (the
library's diff for that class and for the adapter's ``relies_on``), fix the adapter if the steps changed, run the
switch tests (``pytest tests/attention/switch tests/detection``), then ``--write`` records the installed code
(``--interface CLASS``: a Hugging Face class that now calls ``AttentionInterface`` itself, whose adapter the
switch then leaves aside in that release).
"""

from __future__ import annotations

import importlib
import importlib.util
import sys

from torch import nn

from ..attention.switch.mha import SwitchedMultiheadAttention
from ..attention.switch.reviewed import Mirror, UnreviewedCode, adapter_mirror, record
from ..errors import ArgumentParser


def installed_mirrors() -> list[Mirror]:
    """Every mirror of the installed libraries: the Hugging Face families, timm's switches, PyTorch's
    ``nn.MultiheadAttention``, the mmcv stand-in (a library that is not installed is left out)."""
    mirrors = [adapter_mirror(nn.MultiheadAttention, SwitchedMultiheadAttention)]
    if _importable("transformers"):
        from ..attention.switch.hf.families import FAMILY_MODULES, HF_ADAPTERS

        for qualified, family in FAMILY_MODULES.items():
            module_name, _, class_name = qualified.rpartition(".")
            cls = getattr(importlib.import_module(module_name), class_name)
            importlib.import_module(f"polyattn_lightning.attention.switch.hf.families.{family}")
            mirrors.append(adapter_mirror(cls, HF_ADAPTERS[cls]))
    if _importable("timm"):
        from ..attention.switch.base import ADAPTERS
        from ..attention.switch.timm import set_attention  # noqa: F401  (registers timm's switches in ADAPTERS)

        mirrors += [
            adapter_mirror(cls, adapter) for cls, adapter in ADAPTERS.items() if cls is not nn.MultiheadAttention
        ]
    if _importable("mmdet"):
        try:
            from ..detection import mmcv_ops  # noqa: F401
        except UnreviewedCode:  # the mmcv to review: its stand-in is in place all the same
            pass
        mirrors.append(sys.modules["polyattn_lightning.detection.mmcv_ops"].MIRROR)
    return mirrors


def _importable(name: str) -> bool:
    return importlib.util.find_spec(name) is not None


def status(mirror: Mirror) -> str:
    """The recorded route of the installed code, or ``NOT REVIEWED``."""
    try:
        return mirror.route()
    except UnreviewedCode:
        return "NOT REVIEWED"


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(prog="python -m polyattn_lightning.bench fingerprints", description=__doc__.split("\n")[0])
    parser.add_argument("--write", action="store_true", help="record the installed code as reviewed")
    parser.add_argument(
        "--interface",
        action="append",
        default=[],
        metavar="CLASS",
        help="with --write: this HF class (module.Class) calls AttentionInterface itself in the installed release",
    )
    args = parser.parse_args(argv)
    if args.interface and not args.write:
        parser.error("--interface is for --write")
    mirrors = installed_mirrors()
    known = {m.name for m in mirrors}
    unknown = sorted(set(args.interface) - known)
    if unknown:
        parser.error(f"--interface: not a mirrored class: {', '.join(unknown)}")
    if args.write:
        for line in record(mirrors, frozenset(args.interface)) or ["nothing new: every fingerprint was recorded"]:
            print(line)
    missing = 0
    for mirror in sorted(mirrors, key=lambda m: (m.library, m.name)):
        route = status(mirror)
        missing += route == "NOT REVIEWED"
        print(f"{mirror.library:<12} {mirror.installed():<10} {mirror.fingerprint()}  {route:<12} {mirror.name}")
    if missing:
        print(f"{missing} not reviewed: see python -m polyattn_lightning.bench fingerprints --help", file=sys.stderr)
    return 1 if missing else 0


if __name__ == "__main__":
    sys.exit(main())
