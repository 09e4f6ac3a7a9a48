"""The special token ids, the same in every vocabulary, model and search of the project.

Every source and target sequence ends in EOS; PAD fills rows after it and is never predicted; the
decoder's start symbol is PAD (targets shifted right); SEP separates source and target for the
decoder-only model (`source <sep> target`). Vocabularies (data/tokenizer.py) put their pieces at
these ids and number their own words from NUM_SPECIAL on.
"""

PAD_ID = 0  # padding; never a real token
EOS_ID = 1  # end of sentence
UNK_ID = 2  # unknown word or piece
SEP_ID = 3  # source/target separator of the decoder-only model
NUM_SPECIAL = 4

# The pieces of the ids above, in order.
SPECIAL_PIECES = ("<pad>", "</s>", "<unk>", "<sep>")
