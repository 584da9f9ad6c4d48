"""Markdown helpers shared by the diagnostics commands (no torch needed).

The tables mimic the paper's layout: per step a ``(gamma_r, gamma_c)`` column pair with the larger
of the pair in bold (appendix Tables 8-10), values below 0.001 printed as ``<0.001`` (Table 4).
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["markdown_table", "fmt_cv", "fmt_pair", "bold", "shape_str"]


def bold(text: str) -> str:
    """Markdown bold."""
    return f"**{text}**"


def shape_str(shape: Sequence[int]) -> str:
    """``(2736, 1024)`` -> ``2736x1024`` (the paper writes m x n, rows first)."""
    return "x".join(str(int(s)) for s in shape)


def fmt_cv(value: float, digits: int = 3, *, small: bool = True) -> str:
    """A CV with ``digits`` decimals; values that round to zero become ``<0.001`` when ``small``."""
    if small and abs(value) < 10 ** (-digits):
        return "<" + f"{10 ** (-digits):.{digits}f}"
    return f"{value:.{digits}f}"


def fmt_pair(gamma_r: float, gamma_c: float, digits: int = 3) -> tuple[str, str]:
    """Format a ``(gamma_r, gamma_c)`` pair, bolding the larger one as the paper does (ties: rows)."""
    r, c = fmt_cv(gamma_r, digits), fmt_cv(gamma_c, digits)
    return (bold(r), c) if gamma_r >= gamma_c else (r, bold(c))


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[str]], align: str | None = None) -> str:
    """Render a GitHub-flavoured markdown table.

    Args:
        header: column titles.
        rows: cells, already formatted; each row must have ``len(header)`` cells.
        align: one character per column, ``l`` / ``r`` / ``c`` (default: first column left, rest right).
    """
    ncol = len(header)
    for i, row in enumerate(rows):
        if len(row) != ncol:
            raise ValueError(f"markdown_table: row {i} has {len(row)} cells for {ncol} columns")
    align = align or ("l" + "r" * (ncol - 1))
    if len(align) != ncol:
        raise ValueError(f"markdown_table: align has {len(align)} entries for {ncol} columns")
    rule = {"l": ":---", "r": "---:", "c": ":---:"}
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(rule[a] for a in align) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)
