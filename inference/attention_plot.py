"""A picture of where the decoder looked: the last layer's encoder-decoder attention of one
sentence, one panel per head and their average, with the tokens as labels.

    plot_attention("attention.png", weights, token_labels(vocab, source_ids),
                   token_labels(vocab, output_ids), "sentence 0")
"""

from __future__ import annotations

import math

from matplotlib.figure import Figure

from core.errors import UsageError


def token_labels(vocab, ids) -> list[str]:
  """Readable labels of token ids: the vocabulary's pieces or words, else the ids."""
  return [vocab.piece(int(i)) or str(int(i)) for i in ids]


def plot_attention(
  path: str, weights, src_labels: list[str], tgt_labels: list[str], title: str
) -> None:
  """PNG of the last layer's cross-attention: one panel per head, then their average.

  weights: [layers, heads, tgt_len, src_len].
  """
  last = weights[-1]
  panels = [(f"head {h}", w) for h, w in enumerate(last)] + [("average", last.mean(axis=0))]
  cols = min(3, len(panels))
  rows = math.ceil(len(panels) / cols)
  tgt_len, src_len = last.shape[1:]
  width = min(12.0, 1.5 + 0.3 * src_len)
  height = min(12.0, 1.5 + 0.3 * tgt_len)
  fig = Figure(figsize=(cols * width, rows * height), layout="constrained")
  axes = fig.subplots(rows, cols, squeeze=False)
  for ax in axes.flat[len(panels) :]:
    ax.axis("off")
  for ax, (name, w) in zip(axes.flat, panels):
    image = ax.imshow(w, cmap="viridis", vmin=0.0, vmax=1.0, aspect="auto", interpolation="nearest")
    ax.set_xticks(range(src_len), src_labels, rotation=90, fontsize=8)
    ax.set_yticks(range(tgt_len), tgt_labels, fontsize=8)
    ax.set_xlabel("source")
    ax.set_ylabel("target")
    ax.set_title(name)
  fig.colorbar(image, ax=axes, shrink=0.6, label="attention weight")
  fig.suptitle(title)
  try:
    fig.savefig(path, dpi=100)
  except OSError as e:
    raise UsageError(f"{path}: cannot write the plot: {e.strerror or e}") from None
