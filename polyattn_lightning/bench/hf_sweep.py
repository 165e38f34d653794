"""Every base model class of transformers' auto mapping, switched through the one door: none crashes.

``python -m polyattn_lightning.bench hf-sweep [model_type ...]`` builds each ``MODEL_MAPPING_NAMES`` class from
its default config shrunk by :data:`SHRINK` (every attribute of that name the config has, sub-configs too),
skips what does not build that way, is larger than :data:`MAX_PARAMETERS`, or whose own forward fails on the
default probe inputs (``switch/hf/probe.py``), and switches the rest to softmax (compared with HF's own outputs)
and to poly3. Each model is one line: ``switched`` (softmax within 1e-4 of HF's), ``wrong`` (beyond it),
``refused`` (a one-line ``ConfigError``), ``crash`` (any other exception: a defect), ``skipped`` (why); the last
line counts them. The families of the table in ``docs/reference/hf-models.md`` are measured more closely
(``hf-support``); this is the breadth check of "every architecture switches correctly or is refused with one line".
"""

from __future__ import annotations

import copy
import signal
import sys
from collections import Counter

import torch
import transformers

from ..attention.switch import set_attention
from ..attention.switch.hf import probe_inputs
from ..errors import ArgumentParser, ConfigError, closest_option
from . import quiet_loggers
from .hf_support import SOFTMAX_PARITY, run

#: Config attributes set wherever a config has them: 2 layers of width 32, 4 heads, a 64-token vocabulary.
SHRINK = dict(
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=48,
    vocab_size=64,
    d_model=32,
    encoder_layers=2,
    decoder_layers=2,
    encoder_attention_heads=4,
    decoder_attention_heads=4,
    encoder_ffn_dim=48,
    decoder_ffn_dim=48,
    n_embd=32,
    n_layer=2,
    n_head=4,
    num_layers=2,
    num_heads=4,
    d_ff=48,
    d_kv=8,
    head_dim=8,
    max_position_embeddings=64,
    image_size=32,
    patch_size=4,
    initializer_range=0.2,
)
#: Models larger than this after shrinking (an attribute the shrink does not know) are skipped.
MAX_PARAMETERS = 30_000_000
#: Seconds one model may take (build, HF's forward, both switches).
TIMEOUT_S = 20


def shrink(config):
    """``config`` with every :data:`SHRINK` attribute it has set, sub-configs included."""
    for name, value in SHRINK.items():
        if hasattr(config, name):
            try:
                setattr(config, name, value)
            except (AttributeError, TypeError, ValueError):  # a derived property, or a validated field
                pass
    for sub in getattr(config, "sub_configs", None) or {}:
        if hasattr(getattr(config, sub, None), "to_dict"):
            shrink(getattr(config, sub))
    return config


class _Timeout(Exception):
    pass


def _alarm(*_) -> None:
    raise _Timeout


def verdict(model_type: str, class_name: str) -> tuple[str, str]:
    """``(kind, detail)`` of one model class (module docstring)."""
    try:
        torch.manual_seed(0)
        config = shrink(transformers.AutoConfig.for_model(model_type))
        model = getattr(transformers, class_name)(config).eval()
        size = sum(p.numel() for p in model.parameters())
        if size > MAX_PARAMETERS:
            return "skipped", f"{size / 1e6:.0f}M parameters after shrinking"
        inputs = probe_inputs(model)
        expected = run(model, inputs)
    except _Timeout:
        raise
    except Exception as err:  # noqa: BLE001 - not built by the shrink, or HF's own forward fails: no verdict
        return "skipped", f"not built or run as shrunk ({type(err).__name__})"
    try:
        softmax = copy.deepcopy(model)
        set_attention(softmax, "softmax")
        error = (run(softmax, inputs) - expected).abs().max().item()
        set_attention(model, "poly3")
        run(model, inputs)
    except ConfigError as refused:
        return "refused", str(refused)
    except _Timeout:
        raise
    except Exception as err:  # noqa: BLE001 - a crash is what this command looks for
        return "crash", f"{type(err).__name__}: {str(err).splitlines()[0][:200] if str(err) else ''}"
    return ("switched" if error <= SOFTMAX_PARITY else "wrong"), f"softmax {error:.1e} from HF's"


def main(argv: list[str] | None = None) -> int:
    from transformers.models.auto.modeling_auto import MODEL_MAPPING_NAMES

    parser = ArgumentParser(prog="python -m polyattn_lightning.bench hf-sweep", description=__doc__.split("\n")[0])
    parser.add_argument("model_types", nargs="*", help="only these model types (llama, bert...; default: every one)")
    model_types = parser.parse_args(sys.argv[1:] if argv is None else argv).model_types
    for model_type in model_types:
        if model_type not in MODEL_MAPPING_NAMES:
            closest = closest_option(model_type, MODEL_MAPPING_NAMES)
            parser.error(
                f"{model_type!r} is not a model type of transformers' auto mapping"
                + (f" (did you mean {closest!r}?)" if closest else "")
            )
    with quiet_loggers("transformers", "polyattn_lightning"):
        counts = _sweep(MODEL_MAPPING_NAMES, model_types)
    print(", ".join(f"{kind} {counts[kind]}" for kind in ("switched", "refused", "wrong", "crash", "skipped")))
    return 1 if counts["crash"] or counts["wrong"] else 0


def _sweep(mapping: dict, model_types: list[str]) -> Counter[str]:
    """One line per model type of ``mapping`` (only those of ``model_types`` if any); the verdicts counted."""
    signal.signal(signal.SIGALRM, _alarm)
    counts: Counter[str] = Counter()
    for model_type, class_name in sorted(mapping.items()):
        if model_types and model_type not in model_types:
            continue
        class_name = class_name[0] if isinstance(class_name, (list, tuple)) else class_name
        signal.alarm(TIMEOUT_S)
        try:
            kind, detail = verdict(model_type, class_name)
        except _Timeout:
            kind, detail = "skipped", f"over {TIMEOUT_S} s"
        finally:
            signal.alarm(0)
        counts[kind] += 1
        print(f"{model_type:28s} {kind:8s} {detail}", flush=True)
    return counts


if __name__ == "__main__":
    sys.exit(main())
