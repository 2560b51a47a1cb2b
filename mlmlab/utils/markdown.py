"""Markdown for reports: tables as lists of lines."""


def row(cells: list[str]) -> str:
    return "| " + " | ".join(cells) + " |"


def table(header: list[str], body: list[list[str]]) -> list[str]:
    """A header row, its rule, the body rows and a blank line."""
    return [row(header), row(["---"] * len(header)), *(row(cells) for cells in body), ""]
