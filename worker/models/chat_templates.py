"""Chat templates pagedq ships, for `--chat-template FILE`.

`HERMES_TOOLS`: ChatML with tools rendered the Hermes way (`<tool_call>` blocks; the `hermes` tool-call
parser is detected from it), for models whose own template has no tools, such as SmolLM2.
"""

from __future__ import annotations

from pathlib import Path

TEMPLATES = Path(__file__).parent / "templates"
HERMES_TOOLS = TEMPLATES / "hermes_tools.jinja"
