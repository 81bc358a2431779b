"""MkDocs hook of the user guide (mkdocs.yml ``hooks``): Sphinx roles in docstrings become cross-references.

onnxkv's docstrings name other objects as Sphinx roles (``:class:`~onnxkv.Session```).
Markdown renders such a role as the role's text followed by the target as
code (``:class:<code>~onnxkv.Session</code>``).  After each page is rendered this
hook turns that into an optional mkdocs-autorefs reference: a link when the
target is documented in the guide, else the name as code.  ``~`` shows the last
dotted component only, ``title <target>`` shows the title, as Sphinx does.
"""

from __future__ import annotations

import html
import re

#: A role's text and the code span Markdown made of its target.
ROLE = re.compile(r":(?:py:)?(?:class|func|meth|mod|data|attr|exc|obj|const):<code>([^<]+)</code>")
#: The ``title <target>`` form of a role's target (escaped by Markdown).
TITLED = re.compile(r"^(?P<title>.+?)\s*&lt;(?P<target>[^&]+)&gt;$")


def _reference(match: re.Match) -> str:
    text = match[1].strip()
    titled = TITLED.match(text)
    if titled:
        title, target = titled["title"], titled["target"]
    else:
        target = text.removeprefix("~")
        title = target.rsplit(".", 1)[-1] if text.startswith("~") else target
    return f'<autoref identifier="{html.escape(target, quote=True)}" optional><code>{title}</code></autoref>'


def on_page_content(html_text: str, **kwargs) -> str:
    """Replace every rendered Sphinx role of the page by an optional cross-reference."""
    return ROLE.sub(_reference, html_text)
