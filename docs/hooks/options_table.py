# SPDX-License-Identifier: Apache-2.0
"""MkDocs hook: writes the table of ``wrap()``'s options into ``reference/options.md``.

The table comes from the definitions themselves, read at build time without importing the
package (which needs its native module): ``ACCEPTED`` in
``shim_python/trainstream/options.py`` gives each option and the values it takes, and the
``config`` dict at the top of ``wrap()`` in ``shim_python/trainstream/wrap.py`` gives the
defaults. A name ``ACCEPTED`` refers to (``NONFINITE``, say) is looked up in the module it is
imported from. The page holds the marker ``<!-- wrap-options -->`` where the table goes; a page
without it fails the build.
"""

from __future__ import annotations

import ast
import os

MARKER = "<!-- wrap-options -->"
PAGE = "reference/options.md"
PACKAGE = os.path.join("shim_python", "trainstream")


def _module_assignments(path: str) -> tuple[dict, dict, ast.Module]:
    """Module-level ``NAME = <literal>`` nodes, and ``from .x import NAME`` sources."""
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), path)
    values, imports = {}, {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(
                node.targets[0], ast.Name):
            values[node.targets[0].id] = node.value
        elif isinstance(node, ast.ImportFrom) and node.level >= 1 and node.module:
            base = os.path.dirname(path)
            for _ in range(node.level - 1):
                base = os.path.dirname(base)
            source = os.path.join(base, *node.module.split(".")) + ".py"
            for alias in node.names:
                imports[alias.asname or alias.name] = (source, alias.name)
    return values, imports, tree


def _resolve(node: ast.AST, imports: dict) -> object:
    """A literal's value; a name is followed to the module it is imported from."""
    if isinstance(node, ast.Name) and node.id in imports:
        source, name = imports[node.id]
        values, more, _ = _module_assignments(source)
        return _resolve(values[name], more)
    return ast.literal_eval(node)


def _comments_before(lines: list[str], lineno: int) -> str:
    """The ``#`` comment lines right above line ``lineno`` (1-based), joined."""
    out = []
    i = lineno - 2
    while i >= 0 and lines[i].strip().startswith("#"):
        out.insert(0, lines[i].strip().lstrip("#").strip())
        i -= 1
    return " ".join(out)


def accepted_options(root: str) -> list[tuple[str, object, str]]:
    """``(name, accepted values or description, comment)`` for each entry of ``ACCEPTED``."""
    path = os.path.join(root, PACKAGE, "options.py")
    values, imports, _ = _module_assignments(path)
    with open(path, encoding="utf-8") as f:
        lines = f.read().splitlines()
    table = values["ACCEPTED"]
    if not isinstance(table, ast.Dict):
        raise ValueError(f"{path}: ACCEPTED is not a dict literal")
    return [(ast.literal_eval(k), _resolve(v, imports), _comments_before(lines, k.lineno))
            for k, v in zip(table.keys, table.values)]


def wrap_defaults(root: str) -> dict:
    """The ``config`` dict ``wrap()`` starts from: each option's default."""
    path = os.path.join(root, PACKAGE, "wrap.py")
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), path)
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef) and node.name == "wrap":
            for statement in node.body:
                if (isinstance(statement, ast.Assign) and isinstance(statement.value, ast.Dict)
                        and any(isinstance(t, ast.Name) and t.id == "config"
                                for t in statement.targets)):
                    out = {}
                    for k, v in zip(statement.value.keys, statement.value.values):
                        try:
                            out[ast.literal_eval(k)] = ast.literal_eval(v)
                        except ValueError:  # an expression such as 1 << 20
                            out[ast.literal_eval(k)] = eval(compile(  # noqa: S307
                                ast.Expression(v), path, "eval"), {"__builtins__": {}})
                    return out
    raise ValueError(f"{path}: no `config = {{...}}` in wrap()")


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _accepts(value: object) -> str:
    if isinstance(value, tuple):
        return ", ".join(f"`{v!r}`" for v in value)
    return _cell(str(value))


def options_table(root: str) -> str:
    """The Markdown table of every option ``wrap()`` accepts."""
    defaults = wrap_defaults(root)
    rows = ["| option | default | accepts | note |", "|---|---|---|---|"]
    for name, accepted, comment in accepted_options(root):
        default = f"`{defaults[name]!r}`" if name in defaults else ""
        rows.append(f"| `{name}` | {default} | {_accepts(accepted)} | {_cell(comment)} |")
    return "\n".join(rows)


def on_page_markdown(markdown, page, config, files):  # noqa: ARG001 (MkDocs' signature)
    if page.file.src_uri != PAGE:
        return markdown
    if MARKER not in markdown:
        from mkdocs.exceptions import PluginError

        raise PluginError(f"{PAGE} lacks the marker {MARKER}")
    root = os.path.dirname(os.path.abspath(config["config_file_path"]))
    return markdown.replace(MARKER, options_table(root))
