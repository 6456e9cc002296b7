# Sphinx configuration of the course's website and PDF (make book, make pdf).
# course_utils/book.py runs each chapter and stages the pages in build/book-src/;
# this file only says how to render them. Nothing here may fetch from the
# internet: the pages are read offline, from a copy of build/book/.

project = "PyTorch Parallelism, hands-on"
html_title = project
author = "the course's authors"

extensions = [
    "myst_nb",  # notebooks with their stored outputs, MyST markdown
    "sphinx-mathjax-offline",  # MathJax copied into the site, not a CDN
]

# The chapters ran already (course_utils.book): render their outputs as stored.
nb_execution_mode = "off"
nb_merge_streams = True
# the checks' short messages carry ANSI colours, not Python tracebacks
nb_render_error_lexer = "myst-ansi"
# A static page cannot run widgets; book.py replaced each by its default output.
# Without this, myst-nb would load the widget scripts from a CDN.
nb_ipywidgets_js = {}
myst_enable_extensions = ["dollarmath", "amsmath"]
myst_heading_anchors = 3
# A chapter's headings number its sections ("## 3. Streams"): no second numbering.
suppress_warnings = ["myst.header", "mystnb.unknown_mime_type", "toc.not_readable"]

html_theme = "sphinx_book_theme"
html_theme_options = {
    "home_page_in_toc": True,
    "show_navbar_depth": 1,
    "show_toc_level": 2,
    "use_download_button": False,
    "use_fullscreen_button": False,
    "use_repository_button": False,
    "navigation_with_keys": True,
}
html_copy_source = False
html_show_sourcelink = False
html_last_updated_fmt = "%Y-%m-%d"
exclude_patterns = []
html_static_path = ["_static"]
html_css_files = ["book.css"]
