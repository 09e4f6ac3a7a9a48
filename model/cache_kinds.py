"""The decoding cache's three kinds of entry, declared by the collection each is created in.

A model decodes incrementally (`init_cache`, then `decode_step` once per target position) from
flax variables in these collections; search (model/decoder_state.py, model/search.py) treats an
entry by its collection alone, never by its name:

* `STATE` ("cache"): per-row state carried from step to step (decode indices, positions, a
  recurrent state, a row's own copy of what it attends to). Beam search copies it for each beam
  and reorders it with them.
* `TARGET` ("target_cache"): buffers with one slot per target position on axis -2
  ([..., positions, depth], e.g. self-attention keys/values). Carried and reordered as `STATE`
  (beam search keeps them in place and reorders an ancestry table instead when every `STATE`
  entry is a counter shared by all rows: model/ancestry.py); they start short and search grows
  them, segment by segment, as the output gets longer.
* `SOURCE` ("source_cache"): entries that are the same for every beam of a sentence, one row
  per sentence (e.g. the projected source keys/values of encoder-decoder attention). Kept once
  per sentence: never copied per beam, reordered or grown; a step reading one with n = sentences
  x beams query rows must split them into beams itself.

A cache in any other collection is refused by `decoder_state` (a new kind needs a rule here).
"""

STATE = "cache"
TARGET = "target_cache"
SOURCE = "source_cache"
COLLECTIONS = (STATE, TARGET, SOURCE)
CARRIED = (STATE, TARGET)  # what a search carries from step to step


def check_collections(found, model_name: str) -> None:
  """ValueError when a model's decoding cache has a collection of none of the three kinds."""
  unknown = sorted(set(found) - set(COLLECTIONS))
  if unknown:
    raise ValueError(
      f"{model_name}: decoding cache collection(s) {unknown} are of no declared kind; a cache "
      f"entry must be created in one of {list(COLLECTIONS)} (model/cache_kinds.py)"
    )
