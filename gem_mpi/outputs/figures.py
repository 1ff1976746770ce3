"""Figures for the tools that draw runs: matplotlib on the Agg backend (files, no display),
imported only when a tool asks for it, and small PNGs freed once written.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


def pyplot() -> Any:
    """matplotlib.pyplot on the Agg backend: figures are files, no display is needed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plt.rcParams.update({"figure.dpi": 90, "savefig.dpi": 90, "font.size": 8,
                         "axes.grid": True, "grid.alpha": 0.3, "legend.fontsize": 7})
    return plt


def save_figure(fig: Any, path: Path) -> None:
    """Write a figure as a small PNG and free it (tools make many in one process)."""
    fig.tight_layout()
    fig.savefig(path, format="png")
    fig.clf()
    import matplotlib.pyplot as plt

    plt.close(fig)
