"""Each script's --help opens with a whole sentence: those that take their description from
their docstring take its first paragraph (its first line alone once ended `--help` mid-sentence:
"TTFT on one idle serve.py instance, direct and")."""

from __future__ import annotations

import ast
import glob
import os

from conftest import ROOT


def test_help_descriptions_are_whole_sentences():
    checked = 0
    for path in sorted(glob.glob(os.path.join(ROOT, "scripts", "*.py"))):
        source = open(path).read()
        if "description=__doc__" not in source:
            continue
        doc = ast.get_docstring(ast.parse(source), clean=False)
        if 'description=__doc__.split("\\n\\n")[0]' in source:
            shown = doc.split("\n\n")[0]
        else:
            assert "description=__doc__," in source or "description=__doc__)" in source, \
                f"{path}: --help shows part of the docstring other than its first paragraph"
            shown = doc.split("\n\n")[0]  # the whole docstring: its first paragraph opens it
        assert shown.rstrip().endswith((".", ")", ":")), f"{path}: --help says {shown!r}"
        checked += 1
    assert checked >= 10
