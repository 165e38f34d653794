"""``python -m polyattn_lightning.data.lra {listops,pathfinder} --out DIR [...]``: make LRA data locally.

ListOps (LRA's generator) and Pathfinder (:mod:`.snakes`, at 32, 64, 128 = Path-X or 256 px) can be made;
the other tasks' data come from their releases.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from ...errors import ArgumentParser
from ..base import available_cpus
from . import listops, snakes


def main(argv: list[str] | None = None) -> None:
    parser = ArgumentParser(prog="python -m polyattn_lightning.data.lra")
    commands = parser.add_subparsers(dest="command", required=True)
    listops_parser = commands.add_parser(
        "listops",
        help="generate ListOps with LRA's grammar",
        description="Write <out>/listops-1000/basic_{train,val,test}.tsv; defaults are LRA's release sizes.",
    )
    pathfinder_parser = commands.add_parser(
        "pathfinder",
        help="generate Pathfinder images (dashed paths among distractors)",
        description="Write <out>/pathfinder<resolution>/<difficulty>/{imgs,metadata}/ as LRA's release lays them "
        "out; 200k images by default, as the release.",
    )
    for command, spec in ((listops_parser, listops.ListOpsSpec), (pathfinder_parser, snakes.PathfinderSpec)):
        command.add_argument("--out", required=True, help="folder to create; afterwards a --data.root")
        for field in dataclasses.fields(spec):
            command.add_argument(f"--{field.name.replace('_', '-')}", type=int, default=field.default)
    pathfinder_parser.add_argument("--resolution", type=int, default=32, choices=sorted(snakes.GEOMETRY))
    pathfinder_parser.add_argument(
        "--difficulty", default="curv_contour_length_14", choices=sorted(snakes.DIFFICULTIES)
    )
    pathfinder_parser.add_argument("--workers", type=int, default=available_cpus(cap=None), help="processes drawing")
    args = vars(parser.parse_args(argv))
    command, out = args.pop("command"), Path(args.pop("out"))
    if out.exists():
        parser.error(f"{out} exists; choose a new folder")
    if command == "listops":
        spec = listops.ListOpsSpec(**args)
        listops.write_dataset(spec, out)
        print(f"wrote {spec.num_train}/{spec.num_val}/{spec.num_test} expressions to {out / 'listops-1000'}")
        return
    resolution, difficulty, workers = args.pop("resolution"), args.pop("difficulty"), args.pop("workers")
    spec = snakes.PathfinderSpec(**args)
    snakes.write_dataset(spec, out, resolution, difficulty, workers=workers, progress=True)
    print(f"wrote {spec.num_images} images to {out / f'pathfinder{resolution}' / difficulty}")


if __name__ == "__main__":
    main()
