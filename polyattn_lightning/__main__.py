"""``python -m polyattn_lightning fit --config ...``"""

import sys

from .cli import main

sys.argv[0] = "python -m polyattn_lightning"  # the usage line's name; argparse would say ``__main__.py``
main()
