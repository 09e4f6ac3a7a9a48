"""The decoding distribution: what every search, the pool and forced scoring draw a next token
from, written once.

    logits = mask(logits, num_ids)              # PAD (and ids >= num_ids) impossible, float32
    never = impossible(vocab, num_ids)          # [vocab] bool: those ids (a model's own mask)
    logits = mask_where(logits, never)          # the same values, by a select
    logp = log_probs(logits)                    # log-softmax in float32 [n, vocab]
    logp = mix(member_logp)                     # an ensemble: log of the members' mean probability
    logp, aux = mixed(member, params, *args)    # each member run (vmap), checked, then mixed
    count = members(params, "ensemble")         # the ensemble's member axis, checked
    num_ids = useful_num_ids(num_ids, vocab)    # None when it masks nothing
    logp = force(logp, prefix_tok)              # a target prefix's token, where one is due
    tok = choose(logp, key, temperature, top_k) # argmax, or a sample

The decoder never emits PAD (its logit is masked), so PAD only ever means "after EOS"; ids at or
above `num_ids` (output rows the vocabulary has no piece for) are masked the same way. An
ensemble's members are masked PAD-wise one by one, mixed, then masked to `num_ids`, and the
mixture is renormalised by the searches' log-softmax like one model's logits. A target prefix
(model/search.py) is forced by `force`: its token keeps its own log-probability, every other id
goes to -inf, so every search, its scores and the pool follow the prefix by one rule.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from model.special_tokens import EOS_ID, PAD_ID


def impossible(vocab: int, num_ids: int | None = None) -> np.ndarray:
  """[vocab] bool: the ids `mask` makes impossible (PAD, and with `num_ids` every id >= num_ids);
  numpy, so a program that folds it knows it when traced (model/output_table.py)."""
  ids = np.arange(vocab)
  return (ids == PAD_ID) if num_ids is None else (ids == PAD_ID) | (ids >= num_ids)


def mask_where(logits, never):
  """`logits` [..., vocab] with the ids `never` ([vocab] bool, `impossible`) marks at -inf."""
  return jnp.where(never, jnp.asarray(-jnp.inf, logits.dtype), logits)


def mask(logits, num_ids: int | None = None):
  """`logits` [..., vocab] in float32 with PAD and, with `num_ids`, every id >= num_ids at -inf."""
  logits = logits.astype(jnp.float32).at[..., PAD_ID].set(-jnp.inf)
  return logits if num_ids is None else logits.at[..., num_ids:].set(-jnp.inf)


def mask_ids(logits, num_ids: int | None):
  """`logits` [..., vocab] with the ids >= num_ids at -inf (None: unchanged); PAD as it was."""
  return logits if num_ids is None else logits.at[..., num_ids:].set(-jnp.inf)


def log_probs(logits, axis: int = -1):
  """log softmax(logits) in float32, whatever the logits' dtype: [..., vocab]."""
  return jax.nn.log_softmax(logits.astype(jnp.float32), axis=axis)


def mix(member_log_probs, axis: int = 0):
  """An ensemble's next-token log-probabilities from its members' [..., members, ...] along
  `axis`: log(1/M * sum_m p_m(y | prefix)), the mixture fairseq decodes with."""
  count = member_log_probs.shape[axis]
  return jax.nn.logsumexp(member_log_probs, axis=axis) - jnp.log(jnp.float32(count))


def members(params, who: str) -> int:
  """The number of members of an ensemble's `params` (every leaf stacked on one leading member
  axis); ValueError naming `who` when the leaves disagree."""
  sizes = {leaf.shape[0] for leaf in jax.tree_util.tree_leaves(params)}
  if len(sizes) != 1:
    raise ValueError(
      f"{who}: every parameter needs the same leading (member) axis, got sizes {sorted(sizes)}"
    )
  (count,) = sizes
  return count


def mixed(member, params, *args, in_axes=(), out_axes=0, who: str = "ensemble"):
  """An ensemble's log-probabilities from its members: `member(p, *args) -> (log_probs [...,
  vocab], aux)` run for every member of `params` (leaves stacked on a leading member axis,
  checked by `members`), `args` mapped by `in_axes` (one per arg, None: shared; () maps every
  arg's axis 0). Returns (`mix` of the members' log_probs, aux with its member axis at
  `out_axes`)."""
  members(params, who)
  in_axes = in_axes or (0,) * len(args)
  logp, aux = jax.vmap(member, in_axes=(0, *in_axes), out_axes=(0, out_axes))(params, *args)
  return mix(logp), aux


def useful_num_ids(num_ids: int | None, vocab_size: int) -> int | None:
  """`num_ids` as the programs take it: None when it masks nothing (at or above the model's
  `vocab_size`); ValueError when it would leave no id besides PAD and EOS."""
  if num_ids is None:
    return None
  if isinstance(num_ids, bool) or not EOS_ID < num_ids:
    raise ValueError(f"num_ids={num_ids!r}: must exceed the EOS id {EOS_ID}")
  return None if num_ids >= vocab_size else int(num_ids)


def force(logp, tok, keep: bool = True):
  """`logp` [..., vocab] with, in each row whose `tok` [...] is not PAD, every id but `tok` at
  -inf, the forced token keeping its log-probability (`keep`) or at 0 (`keep=False`: the token
  adds nothing to a score); rows with `tok` = PAD unchanged."""
  ids = jnp.arange(logp.shape[-1])
  tok = jnp.asarray(tok)[..., None]
  if keep:
    return jnp.where((tok == PAD_ID) | (ids == tok), logp, -jnp.inf)
  return jnp.where(tok == PAD_ID, logp, jnp.where(ids == tok, 0.0, -jnp.inf))


def choose(logp, key=None, temperature: float = 0.0, top_k: int = 0):
  """A token per row of the log-probabilities `logp` [..., vocab]: the argmax (temperature 0),
  or drawn from softmax(logp / temperature), over the `top_k` most likely only when top_k > 0
  (ties: lower id first), with the one `key`."""
  if isinstance(temperature, (int, float)) and temperature == 0:
    return jnp.argmax(logp, axis=-1)
  if top_k > 0:
    vals, idx = lax.top_k(logp, top_k)
    j = jax.random.categorical(key, vals / temperature, axis=-1)
    return jnp.take_along_axis(idx, j[..., None], axis=-1)[..., 0]
  return jax.random.categorical(key, logp / temperature, axis=-1)
