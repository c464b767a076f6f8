r"""mkdocs hooks (mkdocs.yml `hooks:`): a notebook page's table of contents is read from the headings it really has, and
a page loads MathJax and plotly.js only when it holds math or a figure (docs/overrides/main.html reads `page.meta`), and
the search index leaves out a notebook's code (the API pages index every name; the code was most of the index, which
every page load fetches and indexes again).

mkdocs-jupyter builds the table of contents with Python-Markdown, which leaves inline code out of both the title and
the anchor of an entry (`## \`estimate\`: the whole rank` becomes ": the whole rank" -> `#the-whole-rank`, a heading
of code alone becomes "" -> `#_1`), while the page's headings get ids from the whole text (`estimate-the-whole-rank`):
such entries linked nowhere. Here the entries come from the rendered headings of the markdown cells (the ones with an
anchor link), with their own ids and text.
"""
import html
import re

from mkdocs.structure.toc import get_toc

CODE = re.compile(r"<(pre|code|script|style)\b[^>]*>.*?</\1>", re.S)  # text MathJax does not typeset
# $x$, $$x$$, \(x\), \[x\], \begin{env}: what the site's MathJax typesets
MATH = re.compile(r"\$[^$\n]+\$|\$\$|\\\(|\\\[|\\begin\{")
HEADING = re.compile(r'<h([1-6]) id="([^"]+)">(.*?)<a class="anchor-link"', re.S)


def on_page_content(content, page, **kwargs):
    prose = CODE.sub("", content)
    page.meta["math"] = bool(MATH.search(prose))  # MathJax typesets for about 0.4 s per page in headless Chromium
    page.meta["figures"] = "plotly-graph-div" in content  # plotly.js is 4.6 MB of script to parse
    if not page.file.src_uri.endswith(".ipynb"): return content
    # a code cell,
    for block in ('<div class="highlight-ipynb', '<div class="clipboard-copy-txt', '<span class="notice"'):
        # its copy button's text
        content = content.replace(block, block.replace(" class=", " data-search-exclude class="))
    root = {"level": 0, "children": []}
    stack = [root]
    for level, id_, inner in HEADING.findall(content):
        token = {"level": int(level), "id": id_, "name": html.unescape(re.sub(r"<[^>]+>", "", inner)).strip(),
                 "children": []}
        while stack[-1]["level"] >= token["level"]: stack.pop()
        stack[-1]["children"].append(token)
        stack.append(token)
    page.toc = get_toc(root["children"])
    return content
