"""What a ``save_pretrained`` folder of a switched model carries, and what loads it.

``marks.py``: the activation and the ``attn_implementation`` its config names (:func:`mark_config`), so that the
folder never loads silently as softmax; ``remote_code.py``: :func:`write_remote_code`, the ``trust_remote_code``
route for a process without the project; ``standalone.py``: the file that route copies into the folder.
"""

from .marks import CONFIG_KEY, LOAD_PRETRAINED, SAVED_IMPLEMENTATION_KEY, mark_config
from .remote_code import MODELING_FILE, remote_code_refusal, write_remote_code

__all__ = [
    "CONFIG_KEY",
    "LOAD_PRETRAINED",
    "MODELING_FILE",
    "SAVED_IMPLEMENTATION_KEY",
    "mark_config",
    "remote_code_refusal",
    "write_remote_code",
]
