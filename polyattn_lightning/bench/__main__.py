"""``python -m polyattn_lightning.bench <name> [options]``: run one benchmark by name."""
from __future__ import annotations

import sys

BENCHMARKS = ("attention",)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in BENCHMARKS:
        print(f"usage: python -m polyattn_lightning.bench {{{','.join(BENCHMARKS)}}} [options]", file=sys.stderr)
        return 2
    from . import attention

    return attention.main(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
