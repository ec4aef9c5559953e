"""mkdocs hook: the site's home page is the repository's README.md.

docs/index.md is a stub; its content is replaced by README.md at build time, with the README's links
into docs/ rewritten relative to the site (``docs/masks.md`` -> ``masks.md``), so the front page has
one source and `mkdocs build --strict` still checks every link in it. A page's link to the README
(``../README.md#...``, which works on GitHub) becomes a link to the home page.
"""

from __future__ import annotations

import pathlib
import re

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


def on_page_markdown(markdown: str, page, **_) -> str:
    if page.file.src_uri != "index.md":
        return re.sub(r"\]\((?:\.\./)+README\.md", "](" + "../" * page.file.src_uri.count("/") + "index.md", markdown)
    text = README.read_text(encoding="utf-8")
    return re.sub(r"\]\(docs/", "](", text)
