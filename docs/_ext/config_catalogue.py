"""``.. config-catalogue:: classification``: a table of every YAML file under ``configs/classification/``, read
from the files at build time, so the catalogue cannot drift from ``configs/``.

One row per file: its path, what kind of file it is (a run config that ``lightning fit --config`` takes, a grid
that ``polyattn grid`` takes, or a piece a run config names: data, trainer, recipe, model), the model and the
attention a run config or grid sets, and what the file is for: its leading comment, which every config file
starts with (a file without one is a build error naming it). Every folder directly under ``configs/`` must be
listed by one directive somewhere in the site: a folder left out is a build error too.
"""

from __future__ import annotations

from pathlib import Path

import yaml
from docutils import nodes
from sphinx.util.docutils import SphinxDirective

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = ROOT / "configs"
PIECES = {"data", "trainer", "recipes", "model", "callbacks", "strategy"}
COLUMNS = ("config", "kind", "model", "attention", "what it is for")
WIDTHS = (22, 7, 16, 10, 45)


def leading_comment(path: Path) -> str:
    """The ``#`` lines the file starts with, joined into one paragraph (ValueError where there are none)."""
    lines = []
    for line in path.read_text().splitlines():
        if not line.startswith("#"):
            break
        lines.append(line.lstrip("#").strip())
    if not any(lines):
        raise ValueError(f"{path.relative_to(ROOT)}: no leading comment saying what the config is for")
    return " ".join(part for part in lines if part)


def scale_text(scale) -> str:
    if isinstance(scale, float) and scale > 0 and abs(1 / scale - round(1 / scale)) < 0.01:
        return f"1/{round(1 / scale)}"
    return {"inv_sqrt_n": "1/sqrt(N)"}.get(scale, str(scale))


def attention_text(attention) -> str:
    if isinstance(attention, dict):
        name = attention.get("name", "?")
        return f"{name}, {scale_text(attention['scale'])}" if "scale" in attention else name
    return "" if attention is None else str(attention)


def grid_attention(axes: dict) -> str:
    """The attentions a grid compares (the labels of its axis on ``model.init_args.attention``), else its axes."""
    for name, axis in axes.items():
        if isinstance(axis, dict) and "attention" in str(axis.get("key", "")):
            values = axis.get("values")
            labels = list(values) if isinstance(values, dict) else [attention_text(v) for v in values or []]
            return ("" if name == "attention" else f"{name}: ") + ", ".join(map(str, labels))
    return "axes: " + ", ".join(axes)


def describe(path: Path) -> tuple[str, str, str]:
    """(kind, model, attention) of one YAML file."""
    data = yaml.safe_load(path.read_text())
    parts = set(path.relative_to(CONFIGS).parts[:-1])
    if isinstance(data, dict) and "base" in data and "axes" in data:
        return "grid", f"base: {data['base']}", grid_attention(data["axes"])
    model = data.get("model") if isinstance(data, dict) else None
    if isinstance(model, dict) and "class_path" in model:
        args = model.get("init_args") or {}
        name = args.get("model_name") or args.get("model") or args.get("detector") or args.get("config") or ""
        described = f"{model['class_path'].rsplit('.', 1)[-1]}" + (
            f": {name}" if isinstance(name, str) and name else ""
        )
        return "run", described, attention_text(args.get("attention"))
    return ("piece" if parts & PIECES or "model" in parts else "run"), "", ""


def row(cells: list[str], header: bool = False) -> nodes.row:
    out = nodes.row()
    for column, text in enumerate(cells):
        entry = nodes.entry()
        paragraph = nodes.paragraph()
        paragraph += nodes.literal(text, text) if column == 0 and not header else nodes.Text(text)
        entry += paragraph
        out += entry
    return out


def table(folder: Path) -> nodes.table:
    group = nodes.tgroup(cols=len(COLUMNS))
    for width in WIDTHS:
        group += nodes.colspec(colwidth=width)
    head, body = nodes.thead(), nodes.tbody()
    head += row(list(COLUMNS), header=True)
    for path in sorted(folder.rglob("*.yaml")):
        kind, model, attention = describe(path)
        body += row([str(path.relative_to(ROOT)), kind, model, attention, leading_comment(path)])
    group += head
    group += body
    out = nodes.table(classes=["config-catalogue"])
    out += group
    return out


class ConfigCatalogue(SphinxDirective):
    required_arguments = 1

    def run(self) -> list[nodes.Node]:
        folder = CONFIGS / self.arguments[0]
        if not folder.is_dir():
            raise self.error(f"config-catalogue: no folder {folder.relative_to(ROOT)}")
        try:
            found = table(folder)
        except (ValueError, OSError, yaml.YAMLError) as error:
            raise self.error(f"config-catalogue: {error}") from error
        listed = self.env.__dict__.setdefault("config_catalogue_folders", {})
        listed.setdefault(self.env.docname, set()).add(self.arguments[0])
        for path in folder.rglob("*.yaml"):
            self.env.note_dependency(str(path))
        return [found]


def check_every_folder(app, env) -> None:
    listed = set().union(*getattr(env, "config_catalogue_folders", {}).values())
    missing = sorted(p.name for p in CONFIGS.iterdir() if p.is_dir() and p.name not in listed)
    if missing:
        from sphinx.util import logging

        logging.getLogger(__name__).warning(
            f"config-catalogue: configs/{', configs/'.join(missing)} not listed by any config-catalogue directive"
        )


def purge(app, env, docname) -> None:
    getattr(env, "config_catalogue_folders", {}).pop(docname, None)


def merge(app, env, docnames, other) -> None:
    listed = env.__dict__.setdefault("config_catalogue_folders", {})
    listed.update({d: f for d, f in getattr(other, "config_catalogue_folders", {}).items() if d in docnames})


def setup(app):
    app.add_directive("config-catalogue", ConfigCatalogue)
    app.connect("env-check-consistency", check_every_folder)
    app.connect("env-merge-info", merge)
    app.connect("env-purge-doc", purge)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
