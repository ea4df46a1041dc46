"""Griffe extension for the API pages (named in mkdocs.yml; a docs tool, not part of the package).

Two things griffe cannot do alone here:

* ``lifemem_ray.actors`` lives in the folder ``actors/`` (setuptools' ``package_dir`` mapping,
  see setup.py). Griffe finds packages by folder, and its reading of setuptools' editable
  finder keeps only the folders, not the mapped names, so it sees ``actors`` as a package of
  its own. When ``lifemem_ray`` is loaded, this extension loads ``actors`` from the same
  search paths and hangs it under ``lifemem_ray``: every object in it then has its installed
  path (``lifemem_ray.actors.client.blocking.MemoryClient``). Should that fail, the build
  stops on the first ``lifemem_ray.actors...`` identifier it cannot find.
* The docstrings are written with reStructuredText habits (Sphinx roles such as
  ``:class:`~lifemem_ray.core.model.Trajectory```, ``>>>`` examples, ``::`` before a literal
  block), while the pages are Markdown. A role becomes a code span, an example a ``pycon``
  block, and ``::`` a colon before the indented block. The source files are not changed.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import griffe

ROLE = re.compile(r":(?:py:)?(?:class|func|meth|mod|data|attr|exc|obj|const):`(~?)([^`]+)`")
PACKAGE = "lifemem_ray"
RAY_LAYER_FOLDER = "actors"


def markdown_docstring(text: str) -> str:
    """``text`` with Sphinx roles as code spans, ``>>>`` examples fenced, ``::`` as ``:``."""
    text = ROLE.sub(lambda m: f"``{m.group(2).rsplit('.', 1)[-1] if m.group(1) else m.group(2)}``", text)
    out: list[str] = []
    in_example = False
    for line in text.splitlines():
        if line.lstrip().startswith(">>>") and not in_example:
            if out and out[-1].strip():
                out.append("")
            out.append("```pycon")
            in_example = True
        elif in_example and not line.strip():
            out.append("```")
            in_example = False
        if not in_example and line.rstrip().endswith("::") and line.strip() != "::":
            line = line.rstrip()[:-1]
        out.append(line)
    if in_example:
        out.append("```")
    return "\n".join(out)


def walk(obj: griffe.Object) -> Iterator[griffe.Object]:
    """``obj`` and every object defined under it (aliases left out)."""
    yield obj
    for member in obj.members.values():
        if isinstance(member, griffe.Object):
            yield from walk(member)


class LayoutExtension(griffe.Extension):
    """Hangs ``actors/`` under ``lifemem_ray`` and turns docstrings into Markdown."""

    def __init__(self) -> None:
        super().__init__()
        self._converted: set[int] = set()

    def on_package(self, *, pkg: griffe.Module, loader: griffe.GriffeLoader, **kwargs: Any) -> None:
        if pkg.name != PACKAGE or RAY_LAYER_FOLDER in pkg.members:
            return
        ray_layer = loader.load(RAY_LAYER_FOLDER, try_relative_path=False)
        if not isinstance(ray_layer, griffe.Module):
            return
        del loader.modules_collection.members[RAY_LAYER_FOLDER]
        pkg.set_member(RAY_LAYER_FOLDER, ray_layer)
        for obj in walk(pkg):
            self._convert(obj)

    def _convert(self, obj: griffe.Object) -> None:
        if obj.docstring is not None and id(obj.docstring) not in self._converted:
            obj.docstring.value = markdown_docstring(obj.docstring.value)
            self._converted.add(id(obj.docstring))
