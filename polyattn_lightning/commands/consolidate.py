"""``polyattn consolidate CKPT_DIR --out FILE.ckpt`` / ``--pretrained FOLDER``: a sharded checkpoint made whole.

A sharded run (:class:`~polyattn_lightning.sharding.ShardedStrategy`) writes each checkpoint as a folder of shards.
``--out`` writes a new file, the one-file Lightning checkpoint the DDP path writes (full weights, optimizer states
by parameter index, loops, schedulers, RNG states): it resumes with ``--ckpt_path`` on one process, on DDP or
sharded again on any number of ranks, and every command that reads checkpoints reads it. ``--pretrained`` (Hugging
Face tasks) writes the trained model with ``save_pretrained`` into a new or empty folder:
:func:`polyattn_lightning.attention.switch.hf.load_pretrained` loads it switched to the trained activation (plain
``transformers`` loads a softmax model and refuses any other). Both run in one process, without a process group,
and read the folder without running pickled code.
"""

from __future__ import annotations

from pathlib import Path

from ..checkpoint import atomic_save
from ..errors import ArgumentParser, ConfigError
from ..sharding import read_consolidated
from ..sharding.checkpoints import TASK_KEY, check_sharded_folder, in_memory_file, read_meta
from ..tasks.export import check_export_dir
from .maps import module_class


def parser() -> ArgumentParser:
    p = ArgumentParser(prog="polyattn consolidate", description=__doc__.split("\n")[0].split(": ", 1)[1])
    p.add_argument("ckpt", type=Path, help="a sharded checkpoint folder (.metadata, *.distcp, meta.pt)")
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--out", type=Path, help="the one checkpoint file to write, e.g. last_full.ckpt")
    what.add_argument("--pretrained", type=Path, help="Hugging Face tasks: the save_pretrained folder to write")
    p.add_argument(
        "--model-class", help="the checkpoint's LightningModule class (default: the one that wrote the checkpoint)"
    )
    return p


def export_pretrained(folder: Path, out: Path, class_name: str | None) -> Path:
    """Rebuild the task from the folder's hyperparameters and weights and write its ``save_pretrained`` folder."""
    meta = read_meta(folder)
    name = class_name or meta.get(TASK_KEY) or meta.get("hyper_parameters", {}).get("_class_path")
    if not name:
        raise ConfigError(f"{folder}: the checkpoint does not name its LightningModule class; pass --model-class")
    cls = module_class(name)
    if not callable(getattr(cls, "export", None)):
        raise ConfigError(f"--pretrained: {cls.__name__} has no save_pretrained export (Hugging Face tasks have one)")
    check_export_dir(out, None, "--pretrained")  # nothing the user had is overwritten
    module = cls.load_from_checkpoint(in_memory_file(read_consolidated(folder)), map_location="cpu", weights_only=True)
    return module.export(out)


def main(argv: list[str] | None = None) -> Path:
    """Run the command; returns what it wrote."""
    args = parser().parse_args(argv)
    folder = check_sharded_folder(args.ckpt)
    if args.pretrained is not None:
        written = export_pretrained(folder, args.pretrained, args.model_class)
    else:
        if args.out.exists():  # nothing the user had is overwritten
            raise ConfigError(f"--out {args.out} exists; give a new file name, or move that one away")
        checkpoint = read_consolidated(folder)
        atomic_save(checkpoint, args.out)
        written = args.out
        print(
            f"wrote {written}: {len(checkpoint['state_dict'])} tensors, {len(checkpoint['optimizer_states'])} "
            f"optimizer state(s), step {checkpoint.get('global_step')}"
        )
    return written
