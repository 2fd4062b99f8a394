"""mkdocs hook: drop Sphinx cross-reference roles from rendered docstrings.

The docstrings use ``:func:`name``` (readable in ``help()`` and IDEs); mkdocstrings renders the
role prefix literally ("``:func:``name"). Keep the code span, drop the prefix.
"""

from __future__ import annotations

import re

_ROLE = re.compile(r":(?:py:)?(?:func|class|meth|mod|attr|data|obj|exc|const):(?=<code>)")


def on_page_content(html: str, **kwargs) -> str:
    return _ROLE.sub("", html)
