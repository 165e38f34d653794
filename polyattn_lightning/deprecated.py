"""Old import paths, kept importable for one release as lazy aliases of where their code lives now.

``polyattn_lightning/__init__.py`` installs :class:`AliasFinder`, so ``import polyattn_lightning.attention.timm_patch``
(or unpickling a model saved with a class of that path) gets a stand-in module that looks each name up in the new
modules, on first use, with one ``FutureWarning`` naming the new path. Nothing here imports those modules until a
name is asked for. Moved names of modules that still exist (``attention.attention_norms``...) are looked up
through those modules' ``__getattr__``, which calls :func:`attribute`. Remove an entry one release after its move.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types
import warnings

_PACKAGE = "polyattn_lightning"
_A = f"{_PACKAGE}.attention"
_SWITCH, _KERNELS, _DIAGNOSTICS = f"{_A}.switch", f"{_A}.kernels", f"{_PACKAGE}.diagnostics"
_CLI = f"{_PACKAGE}.cli"

#: Old module -> the modules its names now live in, searched in order (the first is named in the warning).
MOVED_MODULES: dict[str, tuple[str, ...]] = {
    f"{_A}.timm_patch": (
        f"{_SWITCH}.timm",
        f"{_SWITCH}.base",
        f"{_SWITCH}.timm.tables",
        f"{_SWITCH}.timm.families.swin",
        f"{_SWITCH}.timm.probe",
        _SWITCH,
    ),
    f"{_A}.timm_sdpa": (f"{_SWITCH}.timm.sdpa",),
    f"{_A}.timm_probe": (f"{_SWITCH}.timm.probe",),
    f"{_A}.timm_adapters": (f"{_SWITCH}.timm.families",),
    f"{_A}.switched": (f"{_SWITCH}.base",),
    f"{_A}.hf": (f"{_SWITCH}.hf", f"{_SWITCH}.hf.interface", f"{_SWITCH}.hf.masks"),
    f"{_A}.hf_calibration": (f"{_PACKAGE}.conversion.calibrate",),
    f"{_A}.diagnostics": (f"{_DIAGNOSTICS}.norms", f"{_DIAGNOSTICS}.probe"),
    f"{_A}.spline": (f"{_DIAGNOSTICS}.spline",),
    f"{_A}.blocked": (f"{_KERNELS}.blocked",),
    f"{_A}.associative": (f"{_KERNELS}.associative",),
    f"{_A}.fused_cpu": (f"{_KERNELS}.fused_cpu",),
    f"{_A}.cpp": (f"{_KERNELS}.base.cpp",),
    f"{_KERNELS}.cpp": (f"{_KERNELS}.base.cpp",),
    f"{_A}.triton_kernel": (f"{_KERNELS}.triton.op", f"{_KERNELS}.triton.launch", f"{_KERNELS}.triton"),
    f"{_A}.triton_selfcheck": (f"{_KERNELS}.triton.selfcheck",),
    f"{_A}.triton_static": (f"{_PACKAGE}.bench.triton_compile",),
    f"{_A}.timm_support": (f"{_PACKAGE}.bench.timm_support",),
    f"{_PACKAGE}.tasks.models": (f"{_PACKAGE}.models.timm_builder",),
}
#: Old packages whose submodules moved one for one.
MOVED_PACKAGES: dict[str, str] = {f"{_A}.timm_adapters": f"{_SWITCH}.timm.families"}
#: ``(module, old name) -> (module, new name)``: names that moved out of a module that still exists, or renamed, and
#: the old doors: each old ``set_attention`` is the one door (timm_patch's took timm and HF models, hf's HF models).
MOVED_ATTRIBUTES: dict[tuple[str, str], tuple[str, str]] = {
    (f"{_A}.timm_patch", "set_attention"): (_SWITCH, "set_attention"),
    (f"{_A}.hf", "set_attention"): (_SWITCH, "set_attention"),
    (_A, "attention_norms"): (f"{_DIAGNOSTICS}.norms", "attention_norms"),
    (f"{_A}.timm_patch", "XCiTAttention"): (f"{_SWITCH}.timm.sdpa", "Switched_xcit_XCA"),
    (f"{_A}.timm_patch", "ClassAttention"): (f"{_SWITCH}.timm.sdpa", "Switched_cait_ClassAttn"),
    (f"{_A}.timm_patch", "_adapts"): (f"{_SWITCH}.base", "register_adapter"),
    (f"{_A}.switched", "_adapts"): (f"{_SWITCH}.base", "register_adapter"),
    (f"{_A}.switched", "_ADAPTERS"): (f"{_SWITCH}.base", "ADAPTERS"),
    (f"{_A}.timm_sdpa", "_ADAPTERS"): (f"{_SWITCH}.base", "ADAPTERS"),
    **{
        (f"{_PACKAGE}.callbacks.attention_norms", name): (f"{_DIAGNOSTICS}.probe", name)
        for name in ("probing", "probe_batch", "default_probe", "run_probe")
    },
    **{
        (f"{_PACKAGE}.callbacks.attention_norms", name): (f"{_DIAGNOSTICS}.norms", name)
        for name in ("QUANTITIES", "metric_key")
    },
    **{
        (f"{_PACKAGE}.callbacks.attention_maps", name): (f"{_DIAGNOSTICS}.maps", name)
        for name in ("LayerMaps", "collect_maps", "token_map", "stitch_windows")
    },
    **{
        (f"{_PACKAGE}.callbacks.attention_maps", name): (f"{_DIAGNOSTICS}.figures", name)
        for name in ("attention_pictures", "heatmap_figure", "overlay_figure")
    },
    **{
        (f"{_PACKAGE}.callbacks.resume", name): (f"{_PACKAGE}.rng", name)
        for name in ("capture_rng_state", "restore_rng_state")
    },
    (f"{_PACKAGE}.tasks", "create_timm_model"): (f"{_PACKAGE}.models.timm_builder", "create_timm_model"),
    **{
        (f"{_KERNELS}.power", name): (f"{_KERNELS}.base.state", name)
        for name in ("monomials", "device_monomials", "features", "monomial_count", "power_of")
    },
    (f"{_KERNELS}.power", "state_size"): (f"{_KERNELS}.base.state", "monomial_count"),
    (f"{_KERNELS}.power", "key_keep"): (f"{_KERNELS}.base.layout", "key_keep"),
    (f"{_KERNELS}.power", "LENGTH_SCALE_CODES"): (f"{_KERNELS}.power.recurrent", "LENGTH_SCALE_CODES"),
    **{
        (f"{_KERNELS}.power", name): (f"{_KERNELS}.power.parallel", name)
        for name in ("PowerAttentionCPU", "CausalPowerAttentionCPU", "CHUNK_ELEMENTS")
    },
    **{
        (module, "Probe"): (f"{_SWITCH}.hf.switching", "Probe")
        for module in (f"{_SWITCH}.hf", f"{_SWITCH}.hf.interface")
    },
    **{(f"{_SWITCH}.timm", name): (f"{_SWITCH}.timm.switching", name) for name in ("Probe", "log")},
    (f"{_SWITCH}.hf.interface", "DECODE_ROWS"): (f"{_KERNELS}.base.contract", "STEP_ROWS"),
    (f"{_SWITCH}.hf", "SAVED_IMPLEMENTATION_KEY"): (f"{_SWITCH}.hf.saved", "SAVED_IMPLEMENTATION_KEY"),
    (f"{_SWITCH}.hf", "PROBE_ACTIVATION"): (f"{_SWITCH}.hf.switching", "PROBE_ACTIVATION"),
    (f"{_SWITCH}.hf", "MAP_LAYOUTS"): (f"{_SWITCH}.hf.classes", "MAP_LAYOUTS"),
    **{
        (_CLI, name): (f"{_CLI}.{module}", name)
        for module, names in {
            "config": ("class_from_path", "init_args", "as_list", "resolve_task_defaults"),
            "prechecks": ("yaml_references", "check_yaml_syntax", "config_attention", "check_config"),
            "ckpt_path": ("is_lightning_checkpoint", "saved_run_config"),
            "runs": (
                "DEFAULT_RUN_NAME",
                "RUNS_DIR",
                "FOLDER_LOGGERS",
                "EVALUATION_VERBS",
                "KeepingSaveConfigCallback",
                "task_family",
                "activation_label",
                "checkpoint_run_dir",
                "evaluation_dir",
                "saved_configs",
                "resumed_run_dir",
                "resume_command",
            ),
            "parser": (
                "OWN_IMAGES_HINT",
                "NESTED_UNKNOWN",
                "GROUP_UNKNOWN",
                "KeepLinesHelpFormatter",
                "ShortErrorParser",
                "short_parse_message",
                "renamed_options",
            ),
            "defaults": ("default_precision",),
            "console": ("RICH_AVAILABLE", "quiet_known_noise", "without_version"),
            "dispatch": ("COMMANDS",),
        }.items()
        for name in names
    },
    **{
        (module, "SlurmPreemption"): (f"{_PACKAGE}.callbacks.preemption", "StopOnSignal")
        for module in (f"{_PACKAGE}.callbacks", f"{_PACKAGE}.callbacks.preemption")
    },
    **{
        (f"{_PACKAGE}.tasks.detection", name): (f"{_PACKAGE}.detection.config", name)
        for name in ("load_detector_config", "deep_merge", "heads_num_classes", "with_num_classes")
    },
    **{
        (f"{_PACKAGE}.tasks.detection", name): (f"{_PACKAGE}.detection.scoring", name)
        for name in ("coco_metric", "coco_scores", "METRIC_ITEMS", "COCO_REPORT")
    },
    **{
        (f"{_PACKAGE}.tasks.base", name): (f"{_PACKAGE}.tasks.steps.convert", name)
        for name in ("CONVERSION_KEY", "from_deprecated_calibrate")
    },
    (f"{_PACKAGE}.tasks.base", "logits_evaluation"): (f"{_PACKAGE}.tasks.evaluation", "logits_evaluation"),
}

#: ``(old module, name) -> what replaced it``: names that have no new home (asking for one says what to do instead).
REMOVED_ATTRIBUTES: dict[tuple[str, str], str] = {
    (f"{_A}.hf_calibration", "fold_temperatures"): (
        "polyattn_lightning.convert(model, activation, samples, method='calibrate'), which also folds the "
        "temperatures into the query projections"
    ),
    (f"{_KERNELS}.fused_cpu", "decode_with"): (
        "attention(q, k, v, activation, temperature=t): a KV-cache step there runs the same C++ call, resolved once "
        "per activation by the kernels (or fused_cpu.decode)"
    ),
    (f"{_SWITCH}.hf.interface", "materialized_step"): (
        "polyattn_lightning.attention.kernels.materialized.materialized_step, which returns (B, H, R, dv) "
        "(attention()'s layout, not HF's)"
    ),
    (f"{_KERNELS}.power", "fold"): (
        "polyattn_lightning.attention.recurrent_state(k, v, activation, key_padding_mask=...), which returns the "
        "state (a RecurrentState: kv and count together)"
    ),
    (f"{_KERNELS}.power", "row_scales"): (
        "polyattn_lightning.attention.kernels.base.layout.per_row(act.row_scale(n), batch, heads, rows, dtype)"
    ),
    (f"{_KERNELS}.power", "step"): (
        "polyattn_lightning.attention.attention(q, k, v, activation, state=state, is_causal=True), which picks the "
        "recurrent form (kernel_choice(..., state=state) says which)"
    ),
    (f"{_SWITCH}.hf.interface", "probing"): (
        "set_attention(model, activation, probe=...): its probe forward gives every module of the model the probe's "
        "activation and a counting capture meanwhile"
    ),
}


def _targets(name: str) -> tuple[str, ...] | None:
    """The new modules of an old module path (a submodule of a moved package too), or None."""
    if name in MOVED_MODULES:
        return MOVED_MODULES[name]
    for old, new in MOVED_PACKAGES.items():
        if name.startswith(old + "."):
            return (new + name[len(old) :],)
    return None


def _warn(old: str, new: str) -> None:
    warnings.warn(
        f"{old} moved to {new}; the old path is an alias that goes in the next release",
        FutureWarning,
        stacklevel=_caller_level(),
    )


def _caller_level() -> int:
    """The stack level of the first frame outside this module and the import machinery."""
    frame, level = sys._getframe(1), 1
    while frame is not None and (frame.f_code.co_filename == __file__ or "importlib" in frame.f_code.co_filename):
        frame, level = frame.f_back, level + 1
    return level


class AliasModule(types.ModuleType):
    """An old module path: each name is looked up, on use, in the modules its code moved to."""

    def __init__(self, name: str, targets: tuple[str, ...]):
        super().__init__(name, f"moved to {targets[0]}")
        self.__targets = targets

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        if (self.__name__, name) in REMOVED_ATTRIBUTES:
            raise AttributeError(f"{self.__name__}.{name} was removed; use {REMOVED_ATTRIBUTES[self.__name__, name]}")
        moved = MOVED_ATTRIBUTES.get((self.__name__, name))
        if moved is not None:
            return getattr(importlib.import_module(moved[0]), moved[1])
        for target in self.__targets:
            module = importlib.import_module(target)
            try:
                return getattr(module, name)
            except AttributeError:
                continue
        raise AttributeError(f"{self.__name__} (moved to {self.__targets[0]}) has no {name!r}")


class AliasFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds the old module paths of :data:`MOVED_MODULES` and loads them as :class:`AliasModule`."""

    def find_spec(self, fullname, path=None, target=None):
        if _targets(fullname) is None:
            return None
        return importlib.util.spec_from_loader(fullname, self, is_package=fullname in MOVED_PACKAGES)

    def create_module(self, spec):
        targets = _targets(spec.name)
        _warn(spec.name, targets[0])
        return AliasModule(spec.name, targets)

    def exec_module(self, module) -> None:
        if module.__name__ in MOVED_PACKAGES:
            module.__path__ = []  # a package: its old submodules are found by this finder too


def install() -> None:
    """Put the finder on ``sys.meta_path`` (once)."""
    if not any(isinstance(finder, AliasFinder) for finder in sys.meta_path):
        sys.meta_path.append(AliasFinder())


def _asked_for_an_import_path() -> bool:
    """Whether jsonargparse's ``get_import_path`` is asking: it looks a class up by name in each parent package to
    write the shortest ``class_path`` (in ``--help`` and in saved configs); an old alias must not answer, or the
    path written would be one that goes in the next release (and the help would print the deprecation line)."""
    frame = sys._getframe(2)
    for _ in range(3):
        if frame is None:
            return False
        if frame.f_code.co_name == "get_import_path" and "jsonargparse" in frame.f_code.co_filename:
            return True
        frame = frame.f_back
    return False


def attribute(module: str, name: str, lazy: dict[str, str] | None = None):
    """A package ``__getattr__``'s answer: a name of ``lazy`` (name -> the module it is imported from on first use),
    or a moved name of a module that still exists, with the deprecation line (a removed one: what replaced it)."""
    if lazy and name in lazy:
        return getattr(importlib.import_module(lazy[name]), name)
    if (module, name) in REMOVED_ATTRIBUTES:
        raise AttributeError(f"{module}.{name} was removed; use {REMOVED_ATTRIBUTES[module, name]}")
    moved = MOVED_ATTRIBUTES.get((module, name))
    if moved is None or _asked_for_an_import_path():
        raise AttributeError(f"module {module!r} has no attribute {name!r}")
    _warn(f"{module}.{name}", f"{moved[0]}.{moved[1]}")
    return getattr(importlib.import_module(moved[0]), moved[1])
