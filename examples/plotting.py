"""The two-panel figure demo.py and train.py draw (matplotlib is optional: without it they say so
and draw nothing)."""

from __future__ import annotations

import contextlib
import os


@contextlib.contextmanager
def two_panels(path):
    """Yields the (left, right) axes of a figure saved to ``path`` (with legends and grids) when
    the block ends; or None, after a note, where matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"(matplotlib is not installed: no plot written to {path}; pip install matplotlib)")
        yield None
        return
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.6))
    yield ax1, ax2
    for ax in (ax1, ax2):
        ax.legend()
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"wrote {os.path.abspath(path)}")
