"""Training curves as PNG: validation perplexity against tokens seen (from metrics.json history)."""
from __future__ import annotations

from pathlib import Path
from typing import Any


def plot_val_curve(history: list[dict[str, Any]], path: str | Path, title: str = "") -> Path | None:
    """Write the validation-perplexity curve of `history` (entries with tokens_seen, val_ppl; log scale)
    to `path`; None (nothing written) when there are fewer than two validations."""
    points = [(h["tokens_seen"], h["val_ppl"]) for h in history if h.get("val_ppl") is not None]
    if len(points) < 2:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tokens, ppl = zip(*points)
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot([t / 1e6 for t in tokens], ppl, marker="o")
    ax.set_yscale("log")
    ax.set_xlabel("training tokens (M)")
    ax.set_ylabel("validation perplexity")
    ax.set_title(title or "validation perplexity")
    ax.grid(alpha=0.3, which="both")
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
