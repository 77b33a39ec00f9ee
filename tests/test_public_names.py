"""Every public name resolves: each name in the ``__all__`` of the package and of each of its modules that
defines one is an attribute of that module once imported, and the package's own names, imported on first use
(PEP 562's module ``__getattr__``, docs/architecture.md, "Layout"), resolve to the objects of the modules that
define them.

That the package's import changes nothing in PySpark is ``tests/test_packaging.py``'s (in a fresh interpreter).
"""

from __future__ import annotations

import ast
import importlib
import types
from pathlib import Path

import pytest

import spark_credit_shuffle as scs

PACKAGE = "spark_credit_shuffle"
ROOT = Path(scs.__file__).parent


def _module_name(path: Path) -> str:
    parts = [PACKAGE, *path.relative_to(ROOT).with_suffix("").parts]
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _defines_all(path: Path) -> bool:
    """Whether the module's source assigns ``__all__`` at its top level."""
    for node in ast.parse(path.read_text(), str(path)).body:
        targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
        if any(isinstance(t, ast.Name) and t.id == "__all__" for t in targets):
            return True
    return False


#: The package's modules whose source defines ``__all__`` (``__main__`` runs the command line when imported).
MODULES_WITH_ALL = sorted(_module_name(p) for p in ROOT.rglob("*.py") if p.name != "__main__.py" and _defines_all(p))


def test_the_modules_with_all_are_found():
    """The finder above is only as good as its reading of the source: the package and the layers' modules."""
    assert {PACKAGE, f"{PACKAGE}.transport.tcp", f"{PACKAGE}.protocol", f"{PACKAGE}.buffers"} <= set(MODULES_WITH_ALL)
    assert len(MODULES_WITH_ALL) > 50


@pytest.mark.parametrize("name", MODULES_WITH_ALL)
def test_every_name_in_all_is_an_attribute_of_its_module(name):
    module = importlib.import_module(name)
    names = module.__all__
    assert all(isinstance(n, str) for n in names), names
    assert len(set(names)) == len(names), f"{name}.__all__ names some twice"
    missing = [n for n in names if not hasattr(module, n)]
    assert not missing, f"{name}.__all__ names what {name} does not define: {missing}"


def test_the_packages_lazy_names_are_its_all_and_resolve_to_their_modules_objects():
    """Each name the package imports on first use comes from the module ``_EXPORTS`` names, as the same object
    (the function ``exchange``, not the module of that name); ``__all__`` lists them all, and ``dir()`` too."""
    exports: dict[str, str] = scs._EXPORTS
    assert set(scs.__all__) == {*exports, "MIN_PYSPARK", "__version__"}
    assert set(scs.__all__) <= set(dir(scs))
    for name, module in exports.items():
        # the module __getattr__ itself, whether or not an earlier use left the name in the package's globals
        value = scs.__getattr__(name)
        assert value is getattr(importlib.import_module(f"{PACKAGE}.{module}"), name), name
        assert getattr(scs, name) is value, name
        assert not isinstance(value, types.ModuleType), f"{PACKAGE}.{name} is a module, not the public object"


def test_type_checkers_read_the_same_names_from_the_same_modules():
    """The package's ``TYPE_CHECKING`` imports (what a type checker and an IDE see) name each lazy name and the
    module it comes from, as ``_EXPORTS`` does at run time."""
    tree = ast.parse((ROOT / "__init__.py").read_text())
    (block,) = [n for n in tree.body if isinstance(n, ast.If) and ast.unparse(n.test) == "TYPE_CHECKING"]
    typed = {
        alias.name: node.module or "" for node in block.body if isinstance(node, ast.ImportFrom) for alias in node.names
    }
    assert typed == scs._EXPORTS


def test_the_packages_subpackages_resolve_as_attributes_and_unknown_names_do_not():
    for name in sorted(scs._SUBMODULES):
        module = scs.__getattr__(name) if name not in scs._EXPORTS else importlib.import_module(f"{PACKAGE}.{name}")
        assert isinstance(module, types.ModuleType) and module.__name__ == f"{PACKAGE}.{name}", name
    with pytest.raises(AttributeError, match="has no attribute 'no_such_name'"):
        scs.__getattr__("no_such_name")
