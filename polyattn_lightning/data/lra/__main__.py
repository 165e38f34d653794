"""``python -m polyattn_lightning.data.lra listops --out DIR [...]``: make LRA data locally.

Only ListOps can be made (LRA's generator); the other tasks' data come from their releases.
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

from .listops import ListOpsSpec, write_dataset


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m polyattn_lightning.data.lra")
    commands = parser.add_subparsers(dest="command", required=True)
    listops = commands.add_parser(
        "listops",
        help="generate ListOps with LRA's grammar",
        description="Write <out>/listops-1000/basic_{train,val,test}.tsv; defaults are LRA's release sizes.",
    )
    listops.add_argument("--out", required=True, help="folder to create; afterwards a --data.root")
    for field in dataclasses.fields(ListOpsSpec):
        listops.add_argument(f"--{field.name.replace('_', '-')}", type=int, default=field.default)
    args = vars(parser.parse_args(argv))
    del args["command"]
    out = Path(args.pop("out"))
    if out.exists():
        parser.error(f"{out} exists; choose a new folder")
    spec = ListOpsSpec(**args)
    write_dataset(spec, out)
    print(f"wrote {spec.num_train}/{spec.num_val}/{spec.num_test} expressions to {out / 'listops-1000'}")


if __name__ == "__main__":
    main()
