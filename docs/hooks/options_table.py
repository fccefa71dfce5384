# SPDX-License-Identifier: Apache-2.0
"""MkDocs hook: writes the table of ``wrap()``'s options into ``reference/options.md``.

The table comes from the definitions themselves, read at build time without importing the
package (which needs its native module): the ``_option(default, accepts)`` fields of the
option classes ``CONCERNS`` names in ``shim_python/trainstream/options.py`` give each option,
its default and the values it takes, and the comments above a field its note. A name a field
refers to (``NONFINITE``, say) is looked up in the module it is imported from. The page holds
the marker ``<!-- wrap-options -->`` where the table goes; a page without it fails the build.
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


def _literal(node: ast.AST, path: str, imports: dict) -> object:
    """A default's or an accepted set's value: a literal, a name imported from another module,
    or a constant expression such as ``1 << 20``."""
    try:
        return _resolve(node, imports)
    except ValueError:
        return eval(compile(ast.Expression(node), path, "eval"),  # noqa: S307
                    {"__builtins__": {}})


def options(root: str) -> list[tuple[str, object, object, str]]:
    """``(name, default, accepted values or description, comment)`` for each option, from the
    ``_option(default, accepts)`` fields of the classes ``CONCERNS`` names, in its order."""
    path = os.path.join(root, PACKAGE, "options.py")
    values, imports, tree = _module_assignments(path)
    with open(path, encoding="utf-8") as f:
        lines = f.read().splitlines()
    concerns = values.get("CONCERNS")
    if not isinstance(concerns, ast.Tuple):
        raise ValueError(f"{path}: CONCERNS is not a tuple of class names")
    classes = {node.name: node for node in tree.body if isinstance(node, ast.ClassDef)}
    out = []
    for name in (e.id for e in concerns.elts):
        for statement in classes[name].body:
            call = getattr(statement, "value", None)
            if not (isinstance(statement, ast.AnnAssign) and isinstance(call, ast.Call)
                    and getattr(call.func, "id", "") == "_option"):
                continue
            out.append((statement.target.id, _literal(call.args[0], path, imports),
                        _literal(call.args[1], path, imports),
                        _comments_before(lines, statement.lineno)))
    return out


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _accepts(value: object) -> str:
    if isinstance(value, tuple):
        return ", ".join(f"`{v!r}`" for v in value)
    return _cell(str(value))


def options_table(root: str) -> str:
    """The Markdown table of every option ``wrap()`` accepts."""
    rows = ["| option | default | accepts | note |", "|---|---|---|---|"]
    for name, default, accepted, comment in options(root):
        rows.append(f"| `{name}` | `{default!r}` | {_accepts(accepted)} | {_cell(comment)} |")
    return "\n".join(rows)


def on_page_markdown(markdown, page, config, files):  # noqa: ARG001 (MkDocs' signature)
    if page.file.src_uri != PAGE:
        return markdown
    if MARKER not in markdown:
        from mkdocs.exceptions import PluginError

        raise PluginError(f"{PAGE} lacks the marker {MARKER}")
    root = os.path.dirname(os.path.abspath(config["config_file_path"]))
    return markdown.replace(MARKER, options_table(root))
