"""mkdocs hook (mkdocs.yml `hooks:`): a notebook page's table of contents is read from the headings it really has.

mkdocs-jupyter builds the table of contents with Python-Markdown, which leaves inline code out of both the title and
the anchor of an entry (`## \`estimate\`: the whole rank` becomes ": the whole rank" -> `#the-whole-rank`, a heading
of code alone becomes "" -> `#_1`), while the page's headings get ids from the whole text (`estimate-the-whole-rank`):
such entries linked nowhere. Here the entries come from the rendered headings of the markdown cells (the ones with an
anchor link), with their own ids and text.
"""
import html
import re

from mkdocs.structure.toc import get_toc

HEADING = re.compile(r'<h([1-6]) id="([^"]+)">(.*?)<a class="anchor-link"', re.S)


def on_page_content(content, page, **kwargs):
    if not page.file.src_uri.endswith(".ipynb"): return content
    root = {"level": 0, "children": []}
    stack = [root]
    for level, id_, inner in HEADING.findall(content):
        token = {"level": int(level), "id": id_, "name": html.unescape(re.sub(r"<[^>]+>", "", inner)).strip(), "children": []}
        while stack[-1]["level"] >= token["level"]: stack.pop()
        stack[-1]["children"].append(token)
        stack.append(token)
    page.toc = get_toc(root["children"])
    return content
