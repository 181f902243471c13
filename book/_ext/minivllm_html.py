"""The book's Sphinx extension: its own stylesheet, and each inline script once.

Sphinx 7.4 lists an inline script (`app.add_js_file(None, body=...)`) that an extension adds after
the builder started twice: once as given (filename None) and once from its registry (filename ""),
and the two do not compare equal. sphinx-thebe's `const THEBE_JS_URL = ...` then runs twice on
every page, and the second throws `SyntaxError: redeclaration of const THEBE_JS_URL`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

STATIC = Path(__file__).resolve().parent.parent / "_static"


def once_each_script(app: Any, pagename: str, templatename: str, context: dict, doctree) -> None:
    """Drop the second copy of a script; the list is the builder's own, restored per page."""
    scripts = context.get("script_files")
    if not scripts:
        return
    seen, unique = set(), []
    for script in scripts:
        key = (script.filename or "", script.priority, tuple(sorted(script.attributes.items())))
        if key not in seen:
            seen.add(key)
            unique.append(script)
    scripts[:] = unique


def setup(app: Any) -> dict:
    app.connect("builder-inited", lambda app: app.config.html_static_path.append(str(STATIC)))
    app.add_css_file("minivllm.css", priority=900)  # after the theme's
    app.connect("html-page-context", once_each_script, priority=900)  # after pages add theirs
    return {"parallel_read_safe": True, "parallel_write_safe": True}
