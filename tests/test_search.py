"""Tests for model/search.py with hand-written step functions (no Transformer needed).

Two toy decoders drive the searches:
* a table model, logits = ``table[pos, prev_token]`` (hand-set cases);
* a random "hash" model whose logits depend on the whole prefix through a history leaf of
  the cache, so a cache that does not follow its beams gives wrong results.
Both are wrapped in module-level jitted runners taking the model as data, so tests with the
same shapes share one compilation (keeps the file fast on 2 cores).
"""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from model import search
from model.search import (
  beam_search,
  expand_to_beams,
  gather_beams,
  greedy_search,
  length_penalty,
  sample,
)
from model.search_settings import PENALTIES, STOPPING
from model.top_k import beams_top_k, log_softmax_top_k
from tests.helpers import Compilations

PAD, EOS = 0, 1
NEG = -1e4  # logit of tokens that should never be chosen
INF = float("inf")

# Counts executed decode steps (host callback inside the step functions).
_STEPS = [0]


def _tick():
  _STEPS[0] += 1


def count_steps(fn):
  """Runs ``fn()`` and returns (result, number of step_fn calls executed)."""
  _STEPS[0] = 0
  out = jax.block_until_ready(fn())
  jax.effects_barrier()
  return out, _STEPS[0]


# ----------------------------------------------------------------------------- table model

T_LEN, T_VOCAB, T_MAXLEN = 4, 5, 8  # table shape [T_LEN, V, V]; V = PAD, EOS, A=2, B=3, C=4
A, B = 2, 3


def table_step(table, offs):
  """logits = ``table[min(pos, L-1), prev] + offs[row]``; cache = {'i': 0-d, 'row': [n]}."""

  def step_fn(ids, cache):
    jax.debug.callback(_tick)
    i, row = cache["i"], cache["row"]
    logits = table[jnp.minimum(i, table.shape[0] - 1), ids[:, 0]] + offs[row]
    return logits, {"i": i + 1, "row": row}

  return step_fn


def _table_args(table, offs, batch):
  offs = jnp.zeros((batch, table.shape[-1]), table.dtype) if offs is None else offs
  return table_step(table, offs), {"i": jnp.int32(0), "row": jnp.arange(batch)}


@functools.partial(jax.jit, static_argnames=("batch", "max_len"))
def table_greedy(table, offs=None, *, batch=1, max_len=T_MAXLEN):
  return greedy_search(*_table_args(table, offs, batch), batch, max_len)


@functools.partial(jax.jit, static_argnames=("batch", "max_len", "beam", "penalty", "stopping"))
def table_beam(
  table, alpha, offs=None, *, batch=1, max_len=T_MAXLEN, beam=2, penalty="gnmt", stopping=None
):
  return beam_search(
    *_table_args(table, offs, batch),
    batch,
    max_len,
    beam_size=beam,
    alpha=alpha,
    penalty=penalty,
    stopping=stopping,
  )


@functools.partial(jax.jit, static_argnames=("batch", "max_len", "top_k"))
def table_sample(table, key, temperature, *, batch, max_len, top_k):
  step_fn, cache = _table_args(table, None, batch)
  return sample(step_fn, cache, key, batch, max_len, temperature=temperature, top_k=top_k)


def eos_table():
  """[T_LEN, V, V] table where every (pos, prev) gives EOS with probability ~1."""
  t = np.full((T_LEN, T_VOCAB, T_VOCAB), NEG, np.float32)
  t[..., EOS] = 0.0
  return t


def logps(**p):
  """Row of log-probs from token probabilities, e.g. logps(A=.5, EOS=.5); others ~0."""
  names = {"PAD": PAD, "EOS": EOS, "A": A, "B": B, "C": 4}
  row = np.full(T_VOCAB, NEG, np.float32)
  for k, v in p.items():
    row[names[k]] = v if v <= 0 else math.log(v)
  return row


def padded(prefix, max_len=T_MAXLEN):
  return list(prefix) + [PAD] * (max_len - len(prefix))


# ----------------------------------------------------------------------------- hash model

H_LEN, H_VOCAB, H_BATCH, HASH = 9, 6, 4, 97
_HW = np.array([pow(31, j, HASH) for j in range(H_LEN)], np.int32)


def hash_step(w, offs, dtype=jnp.float32):
  """Step fn: logits = ``w[i, hash(prefix)] + offs[row]`` cast to ``dtype``.

  Cache: 'hist' [n, L] int32 (fed tokens, read back for the hash), 'kv' [n, L, 2] float,
  'row' [n] int32 (batch row, gives per-row offsets), 'i' 0-d position.
  """

  def step_fn(ids, cache):
    jax.debug.callback(_tick)
    i = cache["i"]
    n = ids.shape[0]
    assert jnp.ndim(i) == 0 and cache["hist"].shape[0] == cache["kv"].shape[0] == n
    hist = cache["hist"].at[:, i].set(ids[:, 0])
    h = (hist * _HW).sum(-1) % HASH
    kv = cache["kv"].at[:, i, :].set(ids.astype(jnp.float32))
    logits = (w[i, h] + offs[cache["row"]]).astype(dtype)
    return logits, {"hist": hist, "kv": kv, "row": cache["row"], "i": i + 1}

  return step_fn


def hash_cache(batch=H_BATCH, max_len=H_LEN):
  return {
    "hist": jnp.zeros((batch, max_len), jnp.int32),
    "kv": jnp.zeros((batch, max_len, 2), jnp.float32),
    "row": jnp.arange(batch, dtype=jnp.int32),
    "i": jnp.int32(0),
  }


@functools.partial(jax.jit, static_argnames=("dtype",))
def hash_greedy(w, offs, max_lens=None, *, dtype=jnp.float32):
  return greedy_search(hash_step(w, offs, dtype), hash_cache(), H_BATCH, H_LEN, max_lens=max_lens)


@functools.partial(jax.jit, static_argnames=("beam", "dtype", "penalty", "stopping"))
def hash_beam(
  w, offs, alpha, max_lens=None, *, beam, dtype=jnp.float32, penalty="gnmt", stopping=None
):
  return beam_search(
    hash_step(w, offs, dtype),
    hash_cache(),
    H_BATCH,
    H_LEN,
    beam_size=beam,
    alpha=alpha,
    penalty=penalty,
    stopping=stopping,
    max_lens=max_lens,
  )


@functools.partial(jax.jit, static_argnames=("top_k",))
def hash_sample(w, offs, key, temperature=1.0, max_lens=None, *, top_k):
  return sample(
    hash_step(w, offs),
    hash_cache(),
    key,
    H_BATCH,
    H_LEN,
    temperature=temperature,
    top_k=top_k,
    max_lens=max_lens,
  )


def hash_model(seed, eos_bias=0.0, scale=2.0, row_eos=None):
  """Random weights [L, HASH, V] and per-row offsets [batch, V] (float32, as jax arrays)."""
  rng = np.random.default_rng(seed)
  w = rng.normal(size=(H_LEN, HASH, H_VOCAB)).astype(np.float32) * scale
  w[..., EOS] += eos_bias
  w[..., PAD] = NEG
  offs = rng.normal(size=(H_BATCH, H_VOCAB)).astype(np.float32)
  if row_eos is not None:
    offs[:, EOS] += np.asarray(row_eos, np.float32)
  return jnp.asarray(w), jnp.asarray(offs)


def hash_logp_fn(w, offs, row):
  """Reference log-probs (float64) of batch row ``row``: prefix tuple -> [V]."""
  w, offs = np.asarray(w, np.float64), np.asarray(offs, np.float64)

  def logp_fn(prefix):
    seq = (0,) + tuple(prefix)
    h = sum(int(s) * int(_HW[j]) for j, s in enumerate(seq)) % HASH
    x = w[len(prefix), h] + offs[row]
    return x - np.logaddexp.reduce(x)

  return logp_fn


# ----------------------------------------------------------------------------- references


def _lp(n, alpha, penalty="gnmt"):
  return n**alpha if penalty == "fairseq" else ((5.0 + n) / 6.0) ** alpha


def _forced(vocab):
  x = np.full(vocab, -INF)
  x[EOS] = 0.0
  return x


def ref_greedy(logp_fn, max_len, max_len_b=None):
  out = []
  for t in range(max_len):
    forced = max_len_b is not None and t + 1 >= max_len_b
    tok = EOS if forced else int(np.argmax(logp_fn(tuple(out))))
    out.append(tok)
    if tok == EOS:
      break
  return padded(out, max_len)


def ref_beam(logp_fn, vocab, max_len, k, alpha, max_len_b=None, penalty="gnmt", stopping=None):
  """Plain-Python beam search following the documented rules; [(score, ids)] best first."""
  stopping = stopping or ("finished" if penalty == "fairseq" else "exact")
  lp = functools.partial(_lp, alpha=alpha, penalty=penalty)
  lmax = max_len if max_len_b is None else min(max_len_b, max_len)
  live, fin, t, done = [((), 0.0)], [], 0, False
  while t < max_len and not done:
    cands = []
    for bi, (seq, score) in enumerate(live):
      row = _forced(vocab) if max_len_b is not None and t + 1 >= max_len_b else logp_fn(seq)
      cands += [(score + row[v], bi * vocab + v, seq + (v,)) for v in range(vocab)]
    cands = sorted((c for c in cands if c[0] > -INF), key=lambda c: (-c[0], c[1]))[: 2 * k]
    new_fin = [(c[0] / lp(t + 1), c[2]) for c in cands[:k] if c[2][-1] == EOS]
    fin = sorted(fin + new_fin, key=lambda f: -f[0])[:k]
    live = [(c[2], c[0]) for c in cands if c[2][-1] != EOS][:k]
    t += 1
    if k == 1 or stopping == "finished":
      done = len(fin) == k or not live
    else:
      bound = live[0][1] / max(lp(t + 1), lp(lmax)) if live else -INF
      done = bound <= (fin[-1][0] if len(fin) == k else -INF)
  out = fin + sorted(((s / lp(t), seq) for seq, s in live), key=lambda f: -f[0])
  return [(s, padded(seq, max_len)) for s, seq in sorted(out[:k], key=lambda f: -f[0])]


def replay_score(logp_fn, ids, alpha, vocab, max_len_b=None):
  """Score of a returned row by replaying the model: logp / lp(len), len counting EOS."""
  ids = list(ids)
  n = ids.index(EOS) + 1 if EOS in ids else len(ids)
  total = 0.0
  for t in range(n):
    forced = max_len_b is not None and t + 1 >= max_len_b
    lp = _forced(vocab) if forced else logp_fn(tuple(ids[:t]))
    total += lp[ids[t]]
  return total / _lp(n, alpha)


def assert_pad_after_eos(row):
  row = list(np.asarray(row))
  if EOS in row:
    assert all(x == PAD for x in row[row.index(EOS) + 1 :]), row


def assert_matches_ref(ids, scores, ref):
  np.testing.assert_array_equal(ids, [r[1] for r in ref])
  np.testing.assert_allclose(scores, [r[0] for r in ref], rtol=2e-5)


# ----------------------------------------------------------------------------- helpers


def test_length_penalty_values():
  assert float(length_penalty(1, 0.6)) == pytest.approx(1.0)
  assert float(length_penalty(4, 0.6)) == pytest.approx(1.5**0.6)
  assert float(length_penalty(7, 0.0)) == 1.0


@jax.jit
def _expanded_and_gathered(tree, rows):
  """expand_to_beams(tree, 2), and gather_beams of `rows` (batch 2 x beam 3) keeping 3 beams and
  keeping 1, as one program."""
  three = gather_beams(rows, jnp.array([[2, 2, 0], [1, 0, 0]]), 2, 3)
  one = gather_beams(rows, jnp.array([[1], [2]]), 2, 3)  # fewer new beams
  return expand_to_beams(tree, 2), three, one


def test_expand_and_gather_beams():
  tree = {"a": np.arange(6).reshape(2, 3), "i": np.int32(7), "b": np.arange(2.0)}
  rows = {"x": np.arange(6) * 10, "i": np.int32(3)}  # batch 2 x beam 3
  ex, g, g2 = _expanded_and_gathered(tree, rows)
  assert ex["i"].shape == () and int(ex["i"]) == 7
  np.testing.assert_array_equal(ex["a"], [[0, 1, 2], [0, 1, 2], [3, 4, 5], [3, 4, 5]])
  np.testing.assert_array_equal(ex["b"], [0, 0, 1, 1])
  np.testing.assert_array_equal(g["x"], [20, 20, 0, 40, 30, 30])
  assert int(g["i"]) == 3
  np.testing.assert_array_equal(g2["x"], [10, 50])


@functools.partial(jax.jit, static_argnums=(1, 2))
def _beams_and_flat_top_k(x, n, chunk):
  """beams_top_k of x [batch, beam, vocab], and jax.lax.top_k over each row's
  flattened beam * vocab entries (the reference), as one program."""
  return beams_top_k(x, n, chunk), jax.lax.top_k(x.reshape(x.shape[0], -1), n)


@pytest.mark.parametrize(
  "batch,beam,vocab,chunk",
  [
    (3, 4, 50, 64),  # too few slices: plain top_k
    (2, 1, 7, 64),
    (2, 3, 4, 64),
    (1, 2, 2, 64),
    (3, 4, 50, 8),  # each beam: 6 slices of 8 tokens and a shorter one of 2
    (2, 5, 37, 8),  # a shorter last slice, beam * vocab no multiple of the chunk either
    (2, 5, 64, 16),  # whole slices only
    (2, 3, 1001, 64),
    (2, 5, 8000, 64),  # beam search's shape on the Multi30k model
  ],
)
def test_beams_top_k_equals_flat_top_k(batch, beam, vocab, chunk):
  rng = np.random.default_rng(batch * 100 + beam * 10 + vocab + chunk)
  n = 2 * beam
  shape = (batch, beam, vocab)
  few = rng.integers(0, 3, shape).astype(np.float32)  # many ties within and across beams
  dead = few.copy()  # ... and beams at -inf, as beam search's first step has them
  dead[:, 1:] = np.where(rng.random((batch, beam - 1, 1)) < 0.5, -INF, dead[:, 1:])
  one = np.full(shape, -INF, np.float32)  # one entry per beam (a forced token): -inf ties
  one[:, :, vocab // 2] = rng.standard_normal((batch, beam))
  cases = [
    rng.standard_normal(shape),
    few,
    dead,
    one,
    np.where(rng.random(shape) < 0.97, -INF, rng.standard_normal(shape)),
    np.full(shape, -INF),  # all -inf: the lowest flat indices
  ]
  for x in cases:
    (vals, flat), (ref_vals, ref_flat) = _beams_and_flat_top_k(x.astype(np.float32), n, chunk)
    np.testing.assert_array_equal(vals, ref_vals)
    np.testing.assert_array_equal(flat, ref_flat)
    assert flat.dtype == np.int32


@functools.partial(jax.jit, static_argnums=(3, 4))
def _scores_top_k_two_ways(x, offset, forced, n, chunk):
  """log_softmax_top_k of logits x [batch, beam, vocab], and beam search's reference: the
  log-softmax written out (EOS, id 3, the only token of a `forced` row), the offsets added,
  beams_top_k of that and the chosen entries' log-probabilities."""
  logp = jax.nn.log_softmax(x)
  eos_only = jnp.where(jnp.arange(x.shape[-1]) == 3, 0.0, -INF)
  logp = jnp.where(forced[..., None], eos_only, logp)
  vals, flat = beams_top_k(offset[..., None] + logp, n, chunk)
  gain = jnp.take_along_axis(logp.reshape(x.shape[0], -1), flat, axis=1)
  got = log_softmax_top_k(x, offset, n, chunk, only=forced, only_id=3)
  return got, (vals, flat, gain)


@pytest.mark.parametrize(
  "batch,beam,vocab,chunk",
  [(3, 4, 50, 64), (2, 5, 37, 8), (2, 5, 64, 16), (2, 3, 1001, 64), (2, 5, 8000, 64)],
)
def test_log_softmax_top_k_is_beams_top_k_of_the_scores(batch, beam, vocab, chunk):
  """The beams' top-k taken from the logits (slice maxima of the logits, only the chosen slices
  scored) equals the top-k of the written-out scores to the bit, ties included (lower flat index
  first): PAD at -inf, beams at -inf (a first step), rows forced to EOS, equal logits."""
  rng = np.random.default_rng(batch + beam + vocab + chunk)
  shape = (batch, beam, vocab)
  pad = np.where(np.arange(vocab) == 0, -INF, 0.0)  # the step's PAD mask
  offsets = [
    np.zeros((batch, beam)),
    -np.abs(rng.standard_normal((batch, beam))) * 4,
    np.where(np.arange(beam) > 0, -INF, 0.0) * np.ones((batch, 1)),  # one live beam
  ]
  logits = [
    rng.standard_normal(shape) * 3,
    rng.integers(0, 3, shape).astype(np.float64),  # ties within and across beams
    np.where(rng.random(shape) < 0.9, -30.0, rng.standard_normal(shape)),
  ]
  forced = [np.zeros((batch, beam), bool), rng.random((batch, beam)) < 0.5]
  for x in logits:
    for offset in offsets:
      for f in forced:
        args = ((x + pad).astype(np.float32), offset.astype(np.float32), f, 2 * beam, chunk)
        got, want = _scores_top_k_two_ways(*args)
        for a, b in zip(got, want):
          np.testing.assert_array_equal(a, b)
        assert got[1].dtype == np.int32


def test_beams_top_k_stays_a_library_top_k_on_cpu():
  """Consumers that take fewer than all n results (beam search's values[:, :k]) must not turn
  XLA:CPU's top_k into a full sort of the candidates (model/top_k.py's module doc)."""
  if jax.default_backend() != "cpu":
    pytest.skip("XLA:CPU's top_k rewrite")

  def first_half(x):
    vals, flat = beams_top_k(x, 10)
    return vals[:, :5], flat[:, :5]

  hlo = jax.jit(first_half).lower(jnp.zeros((4, 5, 1000))).compile().as_text()
  sorts = [line for line in hlo.splitlines() if " sort(" in line]
  assert all("f32[" not in line.split(" sort(")[0] for line in sorts), sorts
  assert hlo.count('custom_call_target="TopK"') == 2


@functools.partial(jax.jit, static_argnums=(1, 2))
def _chunked_and_plain_top_k(x, n, chunk):
  """beams_top_k of x [..., width] taken as one beam per row, and jax.lax.top_k (the reference)
  of x, as one program."""
  rows = x.reshape(-1, 1, x.shape[-1])
  values, index = beams_top_k(rows, n, chunk)
  return (values.reshape(*x.shape[:-1], n), index.reshape(*x.shape[:-1], n)), jax.lax.top_k(x, n)


@pytest.mark.parametrize(
  "width,n,chunk", [(1000, 8, 16), (777, 3, 8), (300, 8, 64), (513, 2, 32), (1024, 5, 16)]
)
def test_one_beam_top_k_equals_top_k(width, n, chunk):
  """Including ties (lower index first), -inf entries, a width not divisible by the chunk and
  the fallback to plain top_k when there are too few chunks."""
  rng = np.random.default_rng(width + n)
  cases = [
    rng.standard_normal((3, 2, width)),
    rng.integers(0, 4, (3, 2, width)).astype(np.float64),
    np.where(rng.random((3, 2, width)) < 0.97, -INF, rng.standard_normal((3, 2, width))),
    np.full((3, 2, width), -INF),
  ]
  for x in cases:
    (vals, idx), (ref_vals, ref_idx) = _chunked_and_plain_top_k(x.astype(np.float32), n, chunk)
    np.testing.assert_array_equal(vals, ref_vals)
    np.testing.assert_array_equal(idx, ref_idx)


# ----------------------------------------------------------------------------- greedy / sampling


@pytest.mark.parametrize("seed", [0, 1])
def test_greedy_matches_reference_and_pads(seed):
  # Per-row EOS offsets: rows 0/1 (almost) never finish, rows 2/3 finish early.
  w, offs = hash_model(seed, row_eos=[-30.0, -30.0, 1.0, 4.0])
  ids = np.asarray(hash_greedy(w, offs))
  assert ids.shape == (H_BATCH, H_LEN) and ids.dtype == np.int32
  for r, row in enumerate(ids):
    assert list(row) == ref_greedy(hash_logp_fn(w, offs, r), H_LEN)
    assert_pad_after_eos(row)
  assert EOS not in ids[0] and EOS in ids[3]


def test_greedy_stops_early():
  t = eos_table()
  t[0, 0] = logps(A=0.3, B=0.7)
  t[1, B] = logps(A=0.6, B=0.4)
  ids, steps = count_steps(lambda: table_greedy(jnp.asarray(t), jnp.zeros((2, T_VOCAB)), batch=2))
  np.testing.assert_array_equal(ids, [padded([B, A, EOS])] * 2)
  assert steps == 3  # stopped once every row emitted EOS, not after T_MAXLEN steps


@pytest.mark.parametrize("seed", [0, 1])
def test_sample_top_k_1_equals_greedy(seed):
  w, offs = hash_model(seed, eos_bias=0.3)
  greedy = hash_greedy(w, offs)
  for temp in (1.0, 0.3):
    s = hash_sample(w, offs, jax.random.key(seed), temp, top_k=1)
    np.testing.assert_array_equal(s, greedy)


def test_sample_deterministic_given_rng_and_pads():
  w, offs = hash_model(3, scale=0.5)
  a = hash_sample(w, offs, jax.random.key(0), top_k=4)
  np.testing.assert_array_equal(a, hash_sample(w, offs, jax.random.key(0), top_k=4))
  assert not np.array_equal(a, hash_sample(w, offs, jax.random.key(1), top_k=4))
  for row in np.asarray(a):
    assert_pad_after_eos(row)
  # Raw uint32 keys work too.
  np.testing.assert_array_equal(
    hash_sample(w, offs, jax.random.PRNGKey(5), top_k=4),
    hash_sample(w, offs, jax.random.PRNGKey(5), top_k=4),
  )


def test_sample_distribution_temperature_and_top_k():
  p = np.array([0.0, 0.0, 0.5, 0.3, 0.2])
  t = eos_table()
  t[0, 0] = logps(A=0.5, B=0.3, C=0.2)
  n, key = 4000, jax.random.key(7)

  def freqs(temperature=1.0, top_k=0):
    ids = table_sample(jnp.asarray(t), key, temperature, batch=n, max_len=1, top_k=top_k)
    return np.bincount(np.asarray(ids[:, 0]), minlength=T_VOCAB) / n

  np.testing.assert_allclose(freqs(), p, atol=0.03)
  q = p**2 / (p**2).sum()  # temperature 0.5 squares the probabilities
  np.testing.assert_allclose(freqs(temperature=0.5), q, atol=0.03)
  f = freqs(top_k=2)
  assert f[4] == 0.0
  np.testing.assert_allclose(f[2:4], [0.625, 0.375], atol=0.03)


# ----------------------------------------------------------------------------- beam search


@pytest.mark.parametrize(
  "seed,alpha,dtype",
  [(0, 0.6, jnp.float32), (1, 0.0, jnp.float32), (2, 1.0, jnp.float32), (3, 0.6, jnp.bfloat16)],
)
def test_beam_size_1_equals_greedy(seed, alpha, dtype):
  w, offs = hash_model(seed, eos_bias=0.3)
  greedy = hash_greedy(w, offs, dtype=dtype)
  ids, scores = hash_beam(w, offs, alpha, beam=1, dtype=dtype)
  assert ids.shape == (H_BATCH, 1, H_LEN) and scores.shape == (H_BATCH, 1)
  np.testing.assert_array_equal(ids[:, 0], greedy)
  assert np.isfinite(np.asarray(scores)).all()
  if dtype == jnp.float32:  # and with per-sentence max lengths
    max_lens = jnp.array([3, 100, 5, 1])
    ids, _ = hash_beam(w, offs, alpha, max_lens, beam=1)
    np.testing.assert_array_equal(ids[:, 0], hash_greedy(w, offs, max_lens))


def test_beam_size_1_stops_at_first_eos():
  """[EOS] (p=.5) is greedy's choice, but with alpha=.6 the live [A, EOS] (p=.49) scores better:
  -0.713 / 1.097 = -0.650 > -0.693. beam_size=1 still returns greedy's [EOS], also while another
  batch row (always C, never EOS) keeps the loop running; beam_size=2 finds [A, EOS]."""
  t = eos_table()
  t[0, 0] = logps(EOS=0.5, A=0.49, B=0.01)
  t = jnp.asarray(t)
  offs = np.zeros((2, T_VOCAB), np.float32)
  offs[1, EOS], offs[1, 4] = -3e4, 3e4
  greedy = table_greedy(t, offs, batch=2)
  np.testing.assert_array_equal(greedy, [padded([EOS]), [4] * T_MAXLEN])
  ids, scores = table_beam(t, 0.6, offs, batch=2, beam=1)
  np.testing.assert_array_equal(ids[:, 0], greedy)
  assert float(scores[0, 0]) == pytest.approx(math.log(0.5), rel=1e-5)
  ids, scores = table_beam(t, 0.6, beam=2)
  np.testing.assert_array_equal(ids[0], [padded([A, EOS]), padded([EOS])])
  np.testing.assert_allclose(scores[0], [math.log(0.49) / _lp(2, 0.6), math.log(0.5)], rtol=1e-5)


def _two_path_table():
  """Greedy takes A (p=.55), after which everything is weak; B (p=.45) -> EOS (p=.99)."""
  t = eos_table()
  t[0, 0] = logps(A=0.55, B=0.45)
  t[1, A] = logps(EOS=0.33, A=0.34, B=0.33)
  t[1, B] = logps(EOS=0.99, A=0.005, B=0.005)
  return jnp.asarray(t)


@pytest.mark.parametrize("alpha", [0.0, 0.6])
def test_beam_finds_better_sequence_than_greedy(alpha):
  t = _two_path_table()
  np.testing.assert_array_equal(table_greedy(t)[0], padded([A, A, EOS]))
  ids, scores = table_beam(t, alpha)
  np.testing.assert_array_equal(ids[0, 0], padded([B, EOS]))
  expect = (math.log(0.45) + math.log(0.99)) / ((5 + 2) / 6) ** alpha
  assert float(scores[0, 0]) == pytest.approx(expect, rel=1e-5)
  greedy_score = (math.log(0.55) + math.log(0.34)) / ((5 + 3) / 6) ** alpha
  assert float(scores[0, 0]) > greedy_score


def _length_penalty_table():
  """Short [EOS] has log-prob -0.9; long [A, A, A, EOS] has log(1 - e^-0.9) + 2 log .8."""
  t = eos_table()
  t[0, 0] = logps(EOS=-0.9, A=math.log(1 - math.exp(-0.9)))
  t[1, A] = t[2, A] = logps(EOS=0.2, A=0.8)
  return jnp.asarray(t)


def test_length_penalty_choice_and_scores():
  t = _length_penalty_table()
  short, short_logp = padded([EOS]), -0.9
  long, long_logp = padded([A, A, A, EOS]), math.log(1 - math.exp(-0.9)) + 2 * math.log(0.8)
  assert long_logp == pytest.approx(-0.968123, abs=1e-6)

  # alpha = 0: plain log-prob, the short hypothesis wins.
  ids, scores = table_beam(t, 0.0)
  np.testing.assert_array_equal(ids[0], [short, long])
  np.testing.assert_allclose(scores[0], [-0.9, -0.968123], rtol=1e-5)

  # alpha = 0.6: score = logp / ((5 + len) / 6)^0.6 with len counting EOS: len 1 -> lp 1,
  # len 4 -> lp 1.5^0.6 = 1.27542, so the long one wins with -0.968123 / 1.27542 = -0.759059.
  ids, scores = table_beam(t, 0.6)
  np.testing.assert_array_equal(ids[0], [long, short])
  np.testing.assert_allclose(scores[0], [-0.759059, -0.9], rtol=1e-5)
  np.testing.assert_allclose(scores[0], [long_logp / 1.5**0.6, short_logp], rtol=1e-5)


def test_beam_early_stop():
  (ids, _), steps = count_steps(lambda: table_beam(_length_penalty_table(), 0.0))
  # After step 4 both slots are finished and the live beams have log-prob ~ -1e4.
  assert steps == 4
  # No early stop while a live beam can still win: uniform over A, B, C, EOS impossible.
  t = np.zeros((T_LEN, T_VOCAB, T_VOCAB), np.float32)
  t[..., EOS] = t[..., PAD] = NEG
  (ids, scores), steps = count_steps(lambda: table_beam(jnp.asarray(t), 0.6))
  assert steps == T_MAXLEN
  assert (np.asarray(ids) > EOS).all()  # filled with live hypotheses of length max_len
  expect = T_MAXLEN * math.log(1 / 3) / _lp(T_MAXLEN, 0.6)
  np.testing.assert_allclose(scores, np.full((1, 2), expect), rtol=1e-5)


def test_beam_bound_uses_max_length_penalty():
  """After step 2 the finished set is full ([EOS] -0.799, [B, EOS] -1.397/lp(2) = -1.197) and the
  live [B, A] (-1.598) scored at its current length (-1.598/lp(2) = -1.370) looks hopeless, but
  its bound with lp(max_len) is -1.598/lp(8) = -0.737, and it goes on to [B, A, A, EOS] at
  -1.598/lp(4) = -1.065 (alpha = 1)."""
  t = eos_table()
  t[0, 0] = logps(EOS=0.45, B=0.45, A=0.1)
  t[1, B] = logps(EOS=0.55, A=0.45)
  t[2, A] = logps(A=1.0)
  (ids, scores), steps = count_steps(lambda: table_beam(jnp.asarray(t), 1.0))
  np.testing.assert_array_equal(ids[0], [padded([EOS]), padded([B, A, A, EOS])])
  expect = [math.log(0.45), (math.log(0.45) * 2) / _lp(4, 1.0)]
  np.testing.assert_allclose(scores[0], expect, rtol=1e-5)
  assert steps == 4


def test_fairseq_penalty_divides_by_length_power_and_stops_when_the_beam_is_finished():
  """penalty='fairseq' (fairseq's and CTranslate2's search): score = logp / len^alpha, len
  counting EOS, and a sentence is done once beam_size hypotheses have finished, with no bound on
  what a live one could still reach. On the table above, after step 2 the finished set is full
  ([EOS] at -0.799, [B, EOS] at -1.397 / 2 = -0.698), so the search stops there, where the
  GNMT search went on to step 4 for [B, A, A, EOS]."""
  t = eos_table()
  t[0, 0] = logps(EOS=0.45, B=0.45, A=0.1)
  t[1, B] = logps(EOS=0.55, A=0.45)
  t[2, A] = logps(A=1.0)
  (ids, scores), steps = count_steps(lambda: table_beam(jnp.asarray(t), 1.0, penalty="fairseq"))
  assert steps == 2
  expect = {(EOS,): math.log(0.45), (B, EOS): (math.log(0.45) + math.log(0.55)) / 2}
  got = {tuple(int(x) for x in row if x != PAD): float(s) for row, s in zip(ids[0], scores[0])}
  assert got == pytest.approx(expect, rel=1e-5)
  assert list(np.asarray(scores[0])) == sorted(np.asarray(scores[0]), reverse=True)
  # At alpha 0 the two forms score alike, and on this table stop alike too.
  gnmt = table_beam(jnp.asarray(t), 0.0)
  fairseq = table_beam(jnp.asarray(t), 0.0, penalty="fairseq")
  np.testing.assert_array_equal(fairseq[0], gnmt[0])
  np.testing.assert_allclose(fairseq[1], gnmt[1])
  assert float(length_penalty(4, 1.5, "fairseq")) == pytest.approx(4**1.5)


def _stopping_table():
  """The table of the two tests above, where the stopping rules part: after step 2 `beam` = 2
  hypotheses have finished ([EOS], [B, EOS]) while the live [B, A] still goes on to the better
  [B, A, A, EOS] at step 4 (for either penalty at alpha 1)."""
  t = eos_table()
  t[0, 0] = logps(EOS=0.45, B=0.45, A=0.1)
  t[1, B] = logps(EOS=0.55, A=0.45)
  t[2, A] = logps(A=1.0)
  return jnp.asarray(t)


def test_stopping_rule_is_its_own_setting_for_either_penalty():
  """stopping='exact' searches on while a live hypothesis could still win, 'finished' stops once
  `beam` hypotheses have finished, whichever the penalty; unset, each penalty's own rule (gnmt:
  exact, fairseq: finished), so today's searches are unchanged."""
  t = _stopping_table()
  short, b_eos, long = padded([EOS]), padded([B, EOS]), padded([B, A, A, EOS])
  logp = {"short": math.log(0.45), "b_eos": math.log(0.45) + math.log(0.55)}
  logp["long"] = math.log(0.45) + math.log(0.45)
  run = {}
  for penalty in PENALTIES:
    for stopping in (None, *STOPPING):
      fn = lambda: table_beam(t, 1.0, penalty=penalty, stopping=stopping)  # noqa: B023
      (ids, scores), steps = count_steps(fn)
      run[penalty, stopping] = np.asarray(ids[0]), np.asarray(scores[0]), steps
  for penalty, own in (("gnmt", "exact"), ("fairseq", "finished")):
    for got, want in zip(run[penalty, None], run[penalty, own]):
      np.testing.assert_array_equal(got, want)
  # gnmt + exact (its default): on to [B, A, A, EOS] at step 4.
  ids, scores, steps = run["gnmt", "exact"]
  np.testing.assert_array_equal(ids, [short, long])
  np.testing.assert_allclose(scores, [logp["short"], logp["long"] / _lp(4, 1.0)], rtol=1e-5)
  assert steps == 4
  # gnmt + finished: done at step 2 with the first two finished, GNMT-scored.
  ids, scores, steps = run["gnmt", "finished"]
  np.testing.assert_array_equal(ids, [short, b_eos])
  np.testing.assert_allclose(scores, [logp["short"], logp["b_eos"] / _lp(2, 1.0)], rtol=1e-5)
  assert steps == 2
  # fairseq + finished (its default): done at step 2, [B, EOS] first under len^alpha.
  ids, scores, steps = run["fairseq", "finished"]
  np.testing.assert_array_equal(ids, [b_eos, short])
  np.testing.assert_allclose(scores, [logp["b_eos"] / 2, logp["short"]], rtol=1e-5)
  assert steps == 2
  # fairseq + exact: searches on to step 4 and finds a better fairseq score.
  ids, scores, steps = run["fairseq", "exact"]
  np.testing.assert_array_equal(ids, [long, b_eos])
  np.testing.assert_allclose(scores, [logp["long"] / 4, logp["b_eos"] / 2], rtol=1e-5)
  assert steps == 4 and scores[0] > run["fairseq", "finished"][1][0]
  with pytest.raises(ValueError, match=r"stopping='soon': must be one of \('exact', 'finished'\)"):
    table_beam(t, 1.0, stopping="soon")


@pytest.mark.parametrize("penalty,alpha", [("gnmt", 0.6), ("gnmt", 1.5), ("fairseq", 1.0)])
def test_stopping_rules_match_the_reference_and_finished_stops_first(penalty, alpha):
  """Both rules with either penalty on the hash model equal the plain-Python reference; the
  'finished' rule stops no later than 'exact', its scores are no better (the search it stops is
  a prefix of the exact one, whose finished set only improves after), and it equals the exact
  search cut at the step where it stopped (`max_len` = that step: exact's state until then is
  the same, and its bound cannot stop it before the finished set is full)."""
  w, offs = hash_model(5)
  found = {}
  for stopping in STOPPING:
    fn = lambda: hash_beam(w, offs, alpha, beam=3, penalty=penalty, stopping=stopping)  # noqa: B023
    (ids, scores), steps = count_steps(fn)
    found[stopping] = np.asarray(ids), np.asarray(scores), steps
    for b in range(H_BATCH):
      ref = ref_beam(hash_logp_fn(w, offs, b), H_VOCAB, H_LEN, 3, alpha, None, penalty, stopping)
      assert_matches_ref(found[stopping][0][b], found[stopping][1][b], ref)
  assert found["finished"][2] <= found["exact"][2]
  assert (found["finished"][1] <= found["exact"][1] + 1e-6).all()
  assert (found["finished"][1] != found["exact"][1]).any()  # the rules part on this model
  for b in range(H_BATCH):
    logp_fn = hash_logp_fn(w, offs, b)
    ids, scores = found["finished"][0][b], found["finished"][1][b]
    length = max(int(np.sum(row != PAD)) for row in ids)  # the step the entry stopped at
    cut = ref_beam(logp_fn, H_VOCAB, length, 3, alpha, None, penalty, "exact")
    np.testing.assert_array_equal(ids[:, :length], [row for _, row in cut])
    np.testing.assert_allclose(scores, [s for s, _ in cut], rtol=2e-5)


@pytest.mark.parametrize("seed,beam,alpha", [(0, 4, 0.6), (1, 3, 0.0), (2, 4, 1.2), (3, 3, 0.6)])
def test_beam_matches_reference_and_cache_follows_beams(seed, beam, alpha):
  """The step function reads history from the cache: a wrong cache gather changes the result."""
  w, offs = hash_model(seed, eos_bias=-0.5)
  (ids, scores), steps = count_steps(lambda: hash_beam(w, offs, alpha, beam=beam))
  ids, scores = np.asarray(ids), np.asarray(scores)
  assert ids.shape == (H_BATCH, beam, H_LEN) and scores.shape == (H_BATCH, beam)
  assert steps <= H_LEN
  for b in range(H_BATCH):
    logp_fn = hash_logp_fn(w, offs, b)
    assert_matches_ref(ids[b], scores[b], ref_beam(logp_fn, H_VOCAB, H_LEN, beam, alpha))
    assert (np.diff(scores[b]) <= 0).all()  # best first
    for row, s in zip(ids[b], scores[b]):
      assert_pad_after_eos(row)
      assert s == pytest.approx(replay_score(logp_fn, row, alpha, H_VOCAB), rel=2e-5)


def test_beam_without_cache_reorder_is_wrong(monkeypatch):
  """Sanity check of the test above: with the cache gather disabled the result changes."""
  w, offs = hash_model(0, eos_bias=-0.5)
  ref = ref_beam(hash_logp_fn(w, offs, 0), H_VOCAB, H_LEN, 4, 0.6)
  monkeypatch.setattr(search, "gather_beams", lambda tree, idx, b, k: tree)
  # A new jit wrapper: traced with the gather disabled (hash_beam's program has it).
  beam = jax.jit(
    lambda w, offs: beam_search(
      hash_step(w, offs), hash_cache(), H_BATCH, H_LEN, beam_size=4, alpha=0.6
    )
  )
  ids, _ = beam(w, offs)
  assert not np.array_equal(np.asarray(ids[0]), [r[1] for r in ref])


def test_beam_eos_per_beam_finished_stay_finished():
  """Beams finish at different steps; finished rows keep their EOS and are PAD afterwards."""
  w, offs = hash_model(11, eos_bias=0.5)
  ids, scores = hash_beam(w, offs, 0.6, beam=4)
  ids, scores = np.asarray(ids), np.asarray(scores)
  lengths = set()
  for b in range(H_BATCH):
    logp_fn = hash_logp_fn(w, offs, b)
    assert_matches_ref(ids[b], scores[b], ref_beam(logp_fn, H_VOCAB, H_LEN, 4, 0.6))
    for row, s in zip(ids[b], scores[b]):
      assert EOS in row  # all hypotheses finished in this case
      assert_pad_after_eos(row)
      lengths.add(list(row).index(EOS) + 1)
      assert s == pytest.approx(replay_score(logp_fn, row, 0.6, H_VOCAB), rel=2e-5)
  assert len(lengths) > 2  # hypotheses finished at different steps were all kept


def test_max_lens_force_termination():
  w, offs = hash_model(4, eos_bias=-30.0)  # EOS ~never chosen freely
  max_lens = jnp.array([2, 4, 100, 9])
  greedy = np.asarray(hash_greedy(w, offs, max_lens))
  sampled = np.asarray(hash_sample(w, offs, jax.random.key(0), 1.0, max_lens, top_k=0))
  ids, scores = hash_beam(w, offs, 0.6, max_lens, beam=3)
  ids, scores = np.asarray(ids), np.asarray(scores)
  for out in (greedy, sampled, ids[:, 0], ids[:, 1], ids[:, 2]):
    assert list(out[0, 1:]) == padded([EOS], H_LEN - 1) and out[0, 0] > EOS
    assert list(out[1, 3:]) == padded([EOS], H_LEN - 3) and (out[1, :3] > EOS).all()
    assert (out[2] > EOS).all()  # max_lens above max_len: truncated at max_len, no EOS
    assert out[3, -1] == EOS and (out[3, :-1] > EOS).all()  # max_lens == max_len
  for b in range(H_BATCH):
    logp_fn, mlb = hash_logp_fn(w, offs, b), int(max_lens[b])
    assert_matches_ref(ids[b], scores[b], ref_beam(logp_fn, H_VOCAB, H_LEN, 3, 0.6, mlb))
    for row, s in zip(ids[b], scores[b]):
      assert s == pytest.approx(replay_score(logp_fn, row, 0.6, H_VOCAB, mlb), rel=2e-5)
  # The forced EOS costs log-prob 0 and counts in the length: row 0 scores logp(tok0) / lp(2).
  tok0 = ids[0, 0, 0]
  assert scores[0, 0] == pytest.approx(hash_logp_fn(w, offs, 0)(())[tok0] / _lp(2, 0.6), rel=1e-5)
  # Live hypotheses at max_len (row 2) are scored with len = max_len.
  assert scores[2, 0] == pytest.approx(
    replay_score(hash_logp_fn(w, offs, 2), ids[2, 0], 0.6, H_VOCAB), rel=1e-5
  )


def test_max_lens_stop_loop_early():
  w, offs = hash_model(4, eos_bias=-30.0)
  max_lens = jnp.array([2, 3, 3, 1])
  assert count_steps(lambda: hash_greedy(w, offs, max_lens))[1] == 3
  assert count_steps(lambda: hash_beam(w, offs, 0.6, max_lens, beam=3))[1] == 3


def test_jit_compiles_once():
  traces = []

  @jax.jit
  def decode(w, offs, max_lens):
    traces.append(1)
    step_fn = hash_step(w, offs)
    ids, scores = beam_search(step_fn, hash_cache(), H_BATCH, H_LEN, beam_size=2, max_lens=max_lens)
    return ids, scores, greedy_search(step_fn, hash_cache(), H_BATCH, H_LEN)

  w, offs = hash_model(0)
  with Compilations("jit(decode)") as compiled:
    out1 = decode(w, offs, jnp.array([5, 9, 9, 2]))
    out2 = decode(w * 0.5, offs, jnp.array([3, 9, 9, 9]))
    out3 = decode(w, offs, jnp.array([5, 9, 9, 2]))
  assert len(traces) == 1 and compiled.count == 1
  for a, b in zip(out1, out3):
    np.testing.assert_array_equal(a, b)
  assert not np.array_equal(out1[0], out2[0])


def _table_token_logp(table, ids, forced_at=None):
  """Each token's log-probability of the rows `ids` [n, max_len] under the table model (float64
  log-softmax), 0 after EOS and for an EOS forced at step `forced_at[row]` - 1."""
  out = np.zeros(ids.shape, np.float64)
  for r, row in enumerate(ids):
    prev = 0
    for t, tok in enumerate(row):
      logits = table[min(t, table.shape[0] - 1), prev].astype(np.float64)
      logp = logits - np.log(np.exp(logits - logits.max()).sum()) - logits.max()
      forced = forced_at is not None and t + 1 >= forced_at[r]
      out[r, t] = 0.0 if forced else logp[tok]
      if tok == EOS:
        break
      prev = tok
  return out


def test_searches_return_their_scores_and_token_log_probabilities():
  """`scores=True` (greedy, sampling) and `token_scores=True` (beam search) return each token's
  log-probability as an independent float64 walk over the table gives it (a forced EOS 0, 0 after
  EOS), summing to the summed score, and beam search's length-normalised score; the ids are those
  of the searches without scores."""
  rng = np.random.default_rng(7)
  table = rng.normal(0.0, 2.0, (T_LEN, T_VOCAB, T_VOCAB)).astype(np.float32)
  table[..., PAD] = NEG
  batch, max_lens = 3, np.array([8, 3, 5], np.int32)

  @jax.jit
  def searches(table, key):
    """Every search of this test, with and without scores, as one program."""
    step, cache = _table_args(table, None, batch)
    found = {
      "greedy": greedy_search(step, cache, batch, T_MAXLEN, max_lens=max_lens, scores=True),
      "greedy plain": greedy_search(step, cache, batch, T_MAXLEN, max_lens=max_lens),
      "sample": sample(step, cache, key, batch, T_MAXLEN, max_lens=max_lens, scores=True),
    }
    for penalty in PENALTIES:
      how = dict(beam_size=3, alpha=0.6, penalty=penalty, max_lens=max_lens)
      found[f"beam {penalty} plain"] = beam_search(step, cache, batch, T_MAXLEN, **how)
      found[f"beam {penalty}"] = beam_search(step, cache, batch, T_MAXLEN, **how, token_scores=True)
    return found

  found = searches(table, jax.random.key(3))
  ids, total, tokp = found["greedy"]
  np.testing.assert_array_equal(ids, found["greedy plain"])
  want = _table_token_logp(table, np.asarray(ids), max_lens)
  np.testing.assert_allclose(tokp, want, atol=1e-5)
  np.testing.assert_allclose(total, want.sum(axis=1), atol=1e-5)
  drawn = found["sample"]
  want = _table_token_logp(table, np.asarray(drawn[0]), max_lens)
  np.testing.assert_allclose(drawn[2], want, atol=1e-5)
  np.testing.assert_allclose(drawn[1], want.sum(axis=1), atol=1e-5)
  for penalty in PENALTIES:
    plain = found[f"beam {penalty} plain"]
    ids, scores, tokp = found[f"beam {penalty}"]
    np.testing.assert_array_equal(ids, plain[0])
    np.testing.assert_array_equal(scores, plain[1])
    rows = np.asarray(ids).reshape(-1, T_MAXLEN)
    want = _table_token_logp(table, rows, np.repeat(max_lens, 3))
    np.testing.assert_allclose(np.asarray(tokp).reshape(rows.shape), want, atol=1e-5)
    lengths = (rows != PAD).sum(axis=1)
    normalised = want.sum(axis=1) / np.asarray(length_penalty(lengths, 0.6, penalty))
    np.testing.assert_allclose(np.asarray(scores).reshape(-1), normalised, rtol=1e-5, atol=1e-5)
