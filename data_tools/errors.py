"""Errors in one line: what every package's one-sentence messages quote from an exception."""
from __future__ import annotations


def first_line(error: BaseException | str, limit: int = 300) -> str:
    """The gist of an error message as one line of at most `limit` characters.

    Library messages can span lines (tracebacks, C++ check text, YAML marks, DCP's per-rank reports):
    this keeps the first non-blank line, joined with the next one when the first is only a heading
    ending in ":" ("Error(s) in loading state_dict for X:"), with runs of whitespace collapsed and
    the end cut to "..." past `limit`. An exception without a message gives its type's name."""
    lines = [text for line in str(error).splitlines() if (text := " ".join(line.split()))]
    if not lines:
        return type(error).__name__ if isinstance(error, BaseException) else ""
    text = f"{lines[0]} {lines[1]}" if len(lines) > 1 and lines[0].endswith(":") else lines[0]
    return text if len(text) <= limit else text[: limit - 3] + "..."
