"""The searches' output table: the shared embedding with their mask folded in, made once per
decoding rather than in every search program.

The searches' step masks the impossible ids (`distribution.impossible`) inside the output
product (`layers.Embed.attend`): x gets a last feature of 1, the embedding E a last column of 0,
or -inf at an impossible id. Built inside a program, that [vocab, d_model + 1] table is made again
at every call, and in bfloat16 converted and laid out again too (docs/experiments.md measures
it). `fold_tables` makes it once, on the host, beside the table itself:

    params = fold_tables(model, params, num_ids)  # each `embedding` leaf -> FoldedTable
    logits = embed.attend(x, impossible=distribution.impossible(vocab, num_ids))  # reads it

`Embed` looks ids up in `table` (`FoldedTable.rows`: a bfloat16 table's rows through its
`bits`, which XLA:CPU gathers without converting the whole table) and takes `folded` for a
product whose mask is the one the table was folded for (`FoldedTable.holds`); any other mask is
folded in the program as before.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from model import distribution
from model.config import INT8


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class FoldedTable:
  """An embedding `table` [..., vocab, d_model] and `folded`: `fold(table, never)` transposed,
  [..., d_model + 1, vocab] (`fold`), for the ids `never = distribution.impossible(vocab,
  num_ids)`. `bits`: a bfloat16 table's bits, whose rows XLA:CPU gathers as they are, where it
  gathers bfloat16 rows from the whole table made float32 at every call."""

  table: jax.Array
  folded: jax.Array
  bits: jax.Array | None  # a bfloat16 table as uint16, for `rows` (None in float32)
  num_ids: int | None = dataclasses.field(metadata={"static": True})  # not a leaf: known at trace

  def holds(self, never) -> bool:
    """Whether `folded`'s column is the mask `never` ([vocab] bool, as
    `distribution.impossible` gives it: numpy, known when the program is traced)."""
    vocab = self.table.shape[-2]
    return (
      isinstance(never, np.ndarray)
      and never.shape == (vocab,)
      and np.array_equal(never, distribution.impossible(vocab, self.num_ids))
    )

  def rows(self, ids):
    """`jnp.take(self.table, ids, 0)`, the same bits: [*ids.shape, d_model]."""
    if self.bits is None:
      return jnp.take(self.table, ids, 0)
    return jax.lax.bitcast_convert_type(jnp.take(self.bits, ids, 0), self.table.dtype)


def fold(table, never):
  """`table` [..., vocab, d] with a last column of 0, -inf where `never` ([vocab] bool), laid out
  transposed for the output product: [..., d + 1, vocab] in the table's dtype (numpy, contiguous,
  for a numpy table; in a program, behind an optimization barrier, so that XLA keeps the
  transposed copy rather than folding the transpose into the product). XLA:CPU's products read
  [d + 1, vocab] faster than [vocab, d + 1] at a search's rows, and sum its d + 1 in another
  order in float32 (the last bits of some logits): made so in and out of a program alike, a
  table folded once (`fold_tables`) gives the step the same bits as one folded in it."""
  xp = np if isinstance(table, np.ndarray) else jnp
  column = xp.where(never, -np.inf, 0.0).astype(table.dtype)[:, None]
  column = xp.broadcast_to(column, table.shape[:-1] + (1,))
  folded = xp.concatenate([table, column], -1).swapaxes(-1, -2)
  return np.ascontiguousarray(folded) if xp is np else jax.lax.optimization_barrier(folded)


def fold_tables(model, params, num_ids: int | None):
  """`params` (as `decoder_state.matrices_for_decoding` gives them) with every `embedding` leaf a
  `FoldedTable` for the mask of `num_ids` (`distribution.useful_num_ids`'s), for a model that
  masks its logits in its output product (`masks_logits`, shared embeddings, not int8); else
  `params` itself. Numpy leaves are folded by numpy (on the host, nothing compiled)."""
  config = model.config
  if not getattr(model, "masks_logits", False) or not getattr(config, "share_embeddings", False):
    return params
  if getattr(config, "dtype", None) == INT8:  # an int8 table is masked after the product
    return params

  def folded(path, x):  # a FoldedTable's own leaves end in attribute names: left as they are
    if getattr(path[-1], "key", None) != "embedding":
      return x
    never = distribution.impossible(x.shape[-2], num_ids)
    bits = None
    if x.dtype.itemsize == 2:  # bfloat16: its rows looked up by their bits (`rows`)
      numpy = isinstance(x, np.ndarray)
      bits = x.view(np.uint16) if numpy else jax.lax.bitcast_convert_type(x, jnp.uint16)
    return FoldedTable(x, fold(x, never), bits, num_ids)

  return jax.tree_util.tree_map_with_path(folded, params)
