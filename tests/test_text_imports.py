"""Inside laps_jax.text the modules import one way: the tokenizer builds incremental decoders,
so the detokenizer must not reach back for the tokenizer (an `if TYPE_CHECKING` import counts)."""

from __future__ import annotations

import os

from test_import_direction import PKG, _imports

TEXT = os.path.join(PKG, "text")


def _module_graph() -> dict[str, set[str]]:
    mods = {f[:-3] for f in os.listdir(TEXT) if f.endswith(".py") and f != "__init__.py"}
    return {m: {i.split(".")[2] for i in _imports(os.path.join(TEXT, m + ".py"))
                if i.startswith("laps_jax.text.") and i.split(".")[2] in mods - {m}}
            for m in mods}


def test_detokenizer_imports_nothing_of_the_text_package():
    assert _module_graph()["detokenizer"] == set()


def test_no_two_text_modules_import_each_other():
    graph = _module_graph()
    for m, deps in graph.items():
        for d in deps:
            assert m not in graph[d], f"laps_jax.text: {m} <-> {d}"
