"""Figures without pyplot: the object-oriented ``matplotlib.figure.Figure`` API.

pyplot keeps global state and resolves a GUI backend on first use; inside an SGLang
process (or anything that imports a stand-in ``IPython``) that resolution raised
``AttributeError: module 'IPython' has no attribute 'get_ipython'`` at the end of a
``qrl-train`` run on the H200 and lost the run's plot. A ``Figure`` renders
with the Agg canvas directly and never touches pyplot.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

__all__ = ["new_figure", "png_bytes", "save_png"]


def new_figure(nrows: int = 1, ncols: int = 1, **kwargs: Any) -> tuple[Any, Any]:
    """``(figure, axes)`` like ``pyplot.subplots`` (``figsize`` goes to the figure, the rest
    to ``Figure.subplots``)."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=kwargs.pop("figsize", None))
    return fig, fig.subplots(nrows, ncols, **kwargs)


def png_bytes(fig: Any, dpi: int = 100, **kwargs: Any) -> bytes:
    """The figure as PNG bytes (Agg)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    FigureCanvasAgg(fig)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi, **kwargs)
    return buf.getvalue()


def save_png(fig: Any, path: str | Path, dpi: int = 100, **kwargs: Any) -> Path:
    """Write the figure atomically as a PNG at ``path``."""
    from .io import atomic_write_bytes

    return atomic_write_bytes(Path(path), png_bytes(fig, dpi, **kwargs))
