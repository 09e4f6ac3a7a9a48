"""The Transformer's building blocks (paper section 3): embeddings and positional encoding,
multi-head attention, the position-wise feed-forward network, and the encoder and decoder layers.

Parameters carry logical axis names (`embed`, `heads`, `kv`, `mlp`, `vocab`) as metadata only;
`training/parallel.py` maps them to a device mesh. Nothing here knows about devices.
"""

from __future__ import annotations

from collections.abc import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax.linen import initializers

from model import attention as attn
from model import cache_kinds, distribution
from model.config import TransformerConfig
from model.dropout import Dropout
from model.output_table import FoldedTable, fold
from model.quantize import Int8Matrix, int8_product, take_rows
from model.stored_params import LayerNorm, StoredParams

_dense_init = initializers.xavier_uniform()


def _kernel(names: tuple[str, ...], init=_dense_init):
  return nn.with_logical_partitioning(init, names)


def product(subscripts: str, x: jax.Array, w, dtype, out_dtype=None) -> jax.Array:
  """`jnp.einsum(subscripts, x, w)` with both operands in `dtype`, summed in float32 whatever
  their dtype; the result in `out_dtype` (default `dtype`). bfloat16 operands then run as XLA:CPU's
  bfloat16 products with float32 sums (AMX or avx512_bf16 where the CPU has them), not as a float32
  product rounded to bfloat16, which on CPUs is as slow as float32 or slower (docs/experiments.md,
  "Decoding speed"). An `Int8Matrix` `w` (decoding with model.dtype 'int8', model/quantize.py)
  makes it an int8 product."""
  if isinstance(w, Int8Matrix):
    return int8_product(subscripts, x, w, out_dtype or dtype)
  out = jnp.einsum(subscripts, x.astype(dtype), w.astype(dtype), preferred_element_type=jnp.float32)
  return out.astype(out_dtype or dtype)


def sinusoidal_encoding(
  positions: jax.Array, d_model: int, layout: str = "interleaved", frequencies: str = "paper"
) -> jax.Array:
  """PE(pos, 2i) = sin(pos / 10000^(2i/d_model)), PE(pos, 2i+1) = cos(same)   (section 3.5).

  `layout='concatenated'` puts the d_model/2 sines first and the cosines after them;
  `frequencies='marian'` takes frequency i as exp(-i ln(10000) / (d_model/2 - 1)) (Marian's
  table is both).

  Args:
    positions: [batch, length] integer positions (explicit, so packed sentences restart at 0).
  Returns:
    [batch, length, d_model] float32.
  """
  if positions.ndim != 2:
    raise ValueError(
      f"sinusoidal_encoding: positions must be [batch, length], got {positions.shape}"
    )
  if d_model % 2:
    raise ValueError(f"sinusoidal_encoding: d_model={d_model} must be even")
  if frequencies == "marian":
    half = d_model // 2
    inv_freq = jnp.exp(jnp.arange(half, dtype=jnp.float32) * -(jnp.log(10000.0) / max(half - 1, 1)))
  else:
    inv_freq = jnp.exp(-jnp.log(10000.0) * jnp.arange(0, d_model, 2, dtype=jnp.float32) / d_model)
  angles = positions.astype(jnp.float32)[..., None] * inv_freq  # [batch, length, d_model/2]
  if layout == "concatenated":
    return jnp.concatenate([jnp.sin(angles), jnp.cos(angles)], axis=-1)
  # Interleave so even channels are sin and odd channels cos, exactly as in the paper.
  return jnp.stack([jnp.sin(angles), jnp.cos(angles)], axis=-1).reshape(*positions.shape, d_model)


def position_encoding(positions: jax.Array, config: TransformerConfig) -> jax.Array:
  """`sinusoidal_encoding` with the table `config` names: [batch, length] -> [batch, length,
  d_model] float32."""
  return sinusoidal_encoding(
    positions, config.d_model, config.position_layout, config.position_frequencies
  )


class Embed(StoredParams):
  """Token embeddings scaled by √d_model (section 3.4); `attend` is the pre-softmax projection
  when the embedding is shared with the output layer."""

  vocab_size: int
  d_model: int
  dtype: jnp.dtype = jnp.float32

  def setup(self):
    self.embedding = self.param(
      "embedding",
      nn.with_logical_partitioning(
        initializers.normal(stddev=self.d_model**-0.5), ("vocab", "embed")
      ),
      (self.vocab_size, self.d_model),
      jnp.float32,
    )

  def __call__(self, tokens: jax.Array) -> jax.Array:
    """[batch, length] ids -> [batch, length, d_model]."""
    table = self.embedding
    if isinstance(table, FoldedTable):
      rows = table.rows(tokens)
    elif isinstance(table, Int8Matrix):
      rows = take_rows(table, tokens)
    else:
      rows = jnp.take(table, tokens, 0)
    return (rows * jnp.sqrt(self.d_model)).astype(self.dtype)

  def attend(self, x: jax.Array, out_dtype=None, impossible=None) -> jax.Array:
    """[batch, length, d_model] -> [batch, length, vocab] logits (x Eᵀ), in `out_dtype` (default
    the computation dtype). `impossible` ([vocab] bool, or None): ids whose logits are -inf.

    Those are folded into the product: x gets a last feature of 1, E a last column of 0, or -inf
    at an impossible id. Every other logit is then the same sum over d_model plus an exact 0: the
    same bits wherever the product's kernel sums d_model in order (measured at real vocabularies,
    docs/experiments.md; within 2 ulp in any case, tests/test_model.py), and no pass over the
    logits to mask them, which XLA:CPU would copy the logits for when several readers follow
    (beam search's top-k, model/top_k.py). An int8 table is masked after the product. A
    `FoldedTable` (model/output_table.py) brings its folded table, made once per decoding."""
    table, once = self.embedding, None
    if isinstance(table, FoldedTable):  # folded once per decoding (model/output_table.py)
      once = table if impossible is not None and table.holds(impossible) else None
      table = table.table
    if impossible is None or isinstance(table, Int8Matrix):
      logits = product("bld,vd->blv", x, table, self.dtype, out_dtype)
      return logits if impossible is None else distribution.mask_where(logits, impossible)
    x = jnp.concatenate([x, jnp.ones(x.shape[:-1] + (1,), x.dtype)], -1)
    folded = fold(table, impossible) if once is None else once.folded
    return product("bld,dv->blv", x, folded, self.dtype, out_dtype)


class Dense(StoredParams):
  """y = x W + b over x's last `inputs` axes: the parameters of `nn.Dense` (`inputs=1`) or
  `nn.DenseGeneral` over several input axes, kernel [*input axes, features] (Xavier over the
  flattened [inputs, features], as those initialise it) and bias [features], logical axis names
  `axes` (the kernel's) and `axes[-1]` (the bias's); the product is `product`'s, the bias added
  in `dtype`, the result in `out_dtype` (default `dtype`)."""

  features: int
  axes: tuple[str, ...]
  dtype: jnp.dtype = jnp.float32
  inputs: int = 1
  use_bias: bool = True
  out_dtype: jnp.dtype | None = None

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    """[..., *input axes] -> [..., features]."""
    shape = (*x.shape[x.ndim - self.inputs :], self.features)

    def init(rng, shape, dtype=jnp.float32):
      flat = _kernel(self.axes)(rng, (int(np.prod(shape[:-1])), shape[-1]), dtype)
      return nn.meta.replace_boxed(flat, jnp.reshape(flat.unbox(), shape))

    kernel = self.param("kernel", init, shape, jnp.float32)
    letters = "abcdefghijklmnopqrstuvwxyz"[: x.ndim + 1]
    split = x.ndim - self.inputs
    kept, summed, out = letters[:split], letters[split:-1], letters[-1]
    y = product(f"{kept}{summed},{summed}{out}->{kept}{out}", x, kernel, self.dtype, self.out_dtype)
    if not self.use_bias:
      return y
    init = nn.with_logical_partitioning(initializers.zeros, self.axes[-1:])
    return y + self.param("bias", init, (self.features,), jnp.float32).astype(self.dtype)


class HeadsKernel(StoredParams):
  """One of W^Q, W^K, W^V: a [d_model, heads, d_k] parameter `<name>/kernel`, stored and
  initialised exactly as `nn.DenseGeneral((heads, d_k))` stores it (Xavier over d_model ×
  heads·d_k), but returned rather than applied, so that projections of the same input can run as
  one matrix product (`MultiHeadAttention._project`)."""

  config: TransformerConfig

  @nn.compact
  def __call__(self) -> jax.Array:
    cfg = self.config
    shape = (cfg.d_model, cfg.num_heads, cfg.d_model // cfg.num_heads)

    def init(rng, shape, dtype=jnp.float32):
      flat = _kernel(("embed", "heads", "kv"))(rng, (shape[0], shape[1] * shape[2]), dtype)
      return nn.meta.replace_boxed(flat, jnp.reshape(flat.unbox(), shape))

    return self.param("kernel", init, shape, jnp.float32)


class MultiHeadAttention(StoredParams):
  """MultiHead(Q, K, V) = Concat(head_1..head_h) W^O, head_i = Attention(Q W_i^Q, K W_i^K, V W_i^V).

  The projections are plain matrices, as in the paper (no biases; a key bias would have zero
  gradient anyway, since softmax ignores a shift shared by all keys).

  With `decode=True` it runs one target position at a time from a key/value cache:
  self-attention appends this step's key/value; cross-attention projects the encoder output
  once (when the cache is created) and reuses it every step.
  """

  config: TransformerConfig
  cross: bool = False

  def _project(self, x: jax.Array, names: tuple[str, ...]) -> list[jax.Array]:
    """x [batch, length, d_model] through the named projections (query/key/value) of the same
    input as one product with their kernels side by side ([d_model, k, heads, d_k]: a few larger
    matmuls run faster than many small ones). Returns k arrays [batch, length, heads, d_k].

    The kernels are stacked on a new axis, not concatenated along `heads`: with the heads sharded
    over the mesh's tensor axis, a concatenation would interleave the shards and make XLA move
    data between devices before and after every product."""
    cfg = self.config
    kernels = [HeadsKernel(cfg, name=name)() for name in names]
    w = jax.tree_util.tree_map(lambda *k: jnp.stack(k, axis=1), *kernels)
    y = product("bld,dnhk->blnhk", x, w, cfg.compute_dtype)
    ys = [y[:, :, i] for i in range(len(names))]
    if cfg.attention_bias:
      shape = (cfg.num_heads, cfg.d_model // cfg.num_heads)
      init = nn.with_logical_partitioning(initializers.zeros, ("heads", "kv"))
      ys = [
        h + self.param(f"{name}_bias", init, shape, jnp.float32).astype(h.dtype)
        for h, name in zip(ys, names)
      ]
    return ys

  @nn.compact
  def __call__(
    self,
    x: jax.Array,
    memory: jax.Array | None,
    mask: jax.Array | None,
    deterministic: bool,
    decode: bool = False,
    return_weights: bool = False,
    raw: jax.Array | None = None,
  ):
    """x: [batch, q_len, d_model]; memory: [batch, kv_len, d_model] (cross) or None (self);
    mask: boolean [batch, 1, q_len, kv_len]. Returns [batch, q_len, d_model].

    `raw` (self-attention decode steps only, `raw_self_keys`): the un-normalised layer input
    [batch, 1, d_model]; the cache keeps its keys and values, and a step past the first attends
    over them (Marian's pre-norm decoder), the first step's output being its normalised value."""
    cfg = self.config
    if x.ndim != 3 or x.shape[-1] != cfg.d_model:
      raise ValueError(
        f"MultiHeadAttention: x must be [batch, length, d_model={cfg.d_model}], got {x.shape}"
      )
    if self.cross:
      (query,) = self._project(x, ("query",))
    else:
      if raw is None:
        query, key, value = self._project(x, ("query", "key", "value"))
      else:  # one product for both inputs
        n = x.shape[1]
        both = self._project(
          jnp.concatenate([x, raw.astype(x.dtype)], axis=1), ("query", "key", "value")
        )
        query, first_value = both[0][:, :n], both[2][:, :n]
        key, value = both[1][:, n:], both[2][:, n:]
    if decode and self.has_variable(
      cache_kinds.SOURCE if self.cross else cache_kinds.TARGET,
      "cross_key" if self.cross else "cached_key",
    ):
      if raw is not None:  # one key at the first step: its (normalised) value is the output
        first = jnp.reshape(self.variables[cache_kinds.STATE]["cache_index"], (-1, 1, 1, 1)) == 0
      out, weights = self._cross_step(query) if self.cross else self._self_step(query, key, value)
      if raw is not None:
        out = jnp.where(first, first_value.astype(out.dtype), out)
      if return_weights:
        self.sow("intermediates", "attention_weights", weights)
      return self._out(out)
    if self.cross:
      key, value, mask = self._cross_key_value(memory, mask, decode)
    elif decode:
      self._create_self_cache(key, value)
    rng = None
    if not deterministic and cfg.attention_dropout_rate > 0:
      rng = self.make_rng("dropout")
    if cfg.attention_impl == "cudnn" and not return_weights and rng is None:
      out = jax.nn.dot_product_attention(query, key, value, mask=mask, implementation="cudnn")
      weights = None
    else:
      out, weights = attn.dot_product_attention(
        query,
        key,
        value,
        mask,
        return_weights=True,
        dropout_rate=cfg.attention_dropout_rate,
        dropout_rng=rng,
      )
    if return_weights:
      self.sow("intermediates", "attention_weights", weights)
    return self._out(out)

  def _out(self, out):
    """[batch, q_len, heads, d_v] -> [batch, q_len, d_model] (W^O)."""
    cfg = self.config
    return Dense(
      cfg.d_model,
      ("heads", "kv", "embed"),
      cfg.compute_dtype,
      inputs=2,
      use_bias=cfg.attention_bias,
      name="out",
    )(out)

  # Decode-time caches are stored heads-major, [batch, heads, length, d_k]: the layout the
  # attention products read without a transpose (one per step per layer otherwise).

  # bfloat16 keys/values are cached as float32 holding their values: XLA:CPU runs the
  # attention's bfloat16 products in float32, so a cache in any 16-bit form would be converted
  # whole at every step; the attention rounds its own operands (`attention.cached_attention`).

  def _create_self_cache(self, key, value):
    """Creates empty self-attention caches sized by a [batch, max_len] dummy target."""
    shape = (key.shape[0], key.shape[2], key.shape[1], key.shape[3])
    for name, x in (("cached_key", key), ("cached_value", value)):
      self.variable(cache_kinds.TARGET, name, jnp.zeros, shape, _stored(x).dtype)
    self.variable(cache_kinds.STATE, "cache_index", lambda: jnp.array(0, jnp.int32))

  def _self_step(self, query, key, value):
    """One decode step of self-attention: writes these positions' keys/values into the cache from
    `cache_index` on and attends over the positions written so far, each query over those up to
    its own. query, key, value: [n, steps, heads, d_k] (steps > 1: a prompt filling the cache in
    one call, model/decoder_only.py). `cache_index` is [] (every row at the same position, as
    `init_cache` makes it) or [n], each row at its own position (continuous batching,
    model/pool.py)."""
    cached_key = self.variable(cache_kinds.TARGET, "cached_key")
    cached_value = self.variable(cache_kinds.TARGET, "cached_value")
    index = self.variable(cache_kinds.STATE, "cache_index")
    i = index.value
    for cached, new in ((cached_key, key), (cached_value, value)):
      new = _stored(new.transpose(0, 2, 1, 3))  # [n, heads, 1, d_k]
      cached.value = write_position(cached.value, new, i)
    steps = query.shape[1]
    index.value = i + steps
    # [1 or n, 1, steps, length]: each row attends to its own prefix.
    last = jnp.reshape(i, (-1, 1, 1, 1))
    if steps > 1:
      last = last + jnp.arange(steps)[:, None]
    mask = jnp.arange(cached_key.value.shape[2]) <= last
    return attn.cached_attention(query, cached_key.value, cached_value.value, mask)

  def _cross_step(self, query):
    """One decode step of encoder-decoder attention over the cached source keys/values.

    query: [n, 1, heads, d_k]. The cache holds [batch, heads, src_len, d_k] per sentence; when
    n = batch × beams (beam search keeps one copy per sentence, see model/generate.py), the
    beams of a sentence become its query positions, so one product serves them all.
    """
    source = self.variables[cache_kinds.SOURCE]
    key, value, mask = source["cross_key"], source["cross_value"], source["cross_mask"]
    n, _, heads, depth = query.shape
    batch = key.shape[0]
    if n % batch:
      raise ValueError(
        f"MultiHeadAttention: {n} decode rows do not split into beams of the "
        f"{batch} cached sentences"
      )
    beams = n // batch
    out, weights = attn.cached_attention(
      query.reshape(batch, beams, heads, depth), key, value, mask
    )  # [batch, beams, heads, d_v], [batch, heads, beams, src]
    weights = weights.transpose(0, 2, 1, 3).reshape(n, heads, 1, -1)
    return out.reshape(n, 1, heads, -1), weights

  def _cross_key_value(self, memory, mask, decode):
    """Keys/values from the encoder output; with `decode`, also cached (projected once)."""
    key, value = self._project(memory, ("key", "value"))
    if decode:
      # The source mask is per sentence ([batch, 1, 1, src_len]) so beams can share it.
      src_mask = jnp.any(mask, axis=2, keepdims=True)
      self.variable(cache_kinds.SOURCE, "cross_key", lambda: key.transpose(0, 2, 1, 3))
      self.variable(cache_kinds.SOURCE, "cross_value", lambda: value.transpose(0, 2, 1, 3))
      self.variable(cache_kinds.SOURCE, "cross_mask", lambda: src_mask)
    return key, value, mask


def write_position(buffer: jax.Array, new: jax.Array, index: jax.Array) -> jax.Array:
  """`buffer` [n, heads, length, d] with `new` [n, heads, steps, d] written from position
  `index`: [] (the same position in every row: one in-place slice update) or [n] (each row its
  own)."""
  if jnp.ndim(index) == 0:
    return jax.lax.dynamic_update_slice(buffer, new, (0, 0, index, 0))
  # One slice update per row (a scatter), not a select over the whole buffer, which would
  # rewrite every position of it at every step.
  row = lambda b, x, i: jax.lax.dynamic_update_slice(b, x, (0, i, 0))
  return jax.vmap(row)(buffer, new, index)


def _stored(x: jax.Array) -> jax.Array:
  """A key/value as the self-attention cache keeps it: bfloat16 as float32 (the same values)."""
  return x.astype(jnp.float32) if x.dtype == jnp.bfloat16 else x


ACTIVATIONS = {
  "relu": nn.relu,
  "swish": lambda x: x * jax.nn.sigmoid(x),
  "gelu": lambda x: x * jax.nn.sigmoid(1.702 * x),  # Marian's gelu
}


class FeedForward(nn.Module):
  """FFN(x) = max(0, x W1 + b1) W2 + b2   (section 3.3); `ffn_activation` may replace max(0, .)
  with swish or Marian's gelu (`ACTIVATIONS`)."""

  config: TransformerConfig

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    """[batch, length, d_model] -> [batch, length, d_model]."""
    cfg = self.config
    h = ACTIVATIONS[cfg.ffn_activation](
      Dense(cfg.d_ff, ("embed", "mlp"), cfg.compute_dtype, name="wi")(x)
    )
    return Dense(cfg.d_model, ("mlp", "embed"), cfg.compute_dtype, name="wo")(h)


def layer_norm(name: str, config: TransformerConfig) -> LayerNorm:
  return LayerNorm(
    epsilon=config.layer_norm_epsilon,
    dtype=config.compute_dtype,
    param_dtype=jnp.float32,
    name=name,
    scale_init=nn.with_logical_partitioning(initializers.ones, ("embed",)),
    bias_init=nn.with_logical_partitioning(initializers.zeros, ("embed",)),
  )


class Residual(nn.Module):
  """LayerNorm(x + Dropout(Sublayer(x)))   (section 5.4, post-LN, the paper's), or with
  `pre_ln`: x + Dropout(Sublayer(LayerNorm(x)))."""

  config: TransformerConfig

  @nn.compact
  def __call__(
    self, x: jax.Array, sublayer: Callable[[jax.Array], jax.Array], deterministic: bool
  ) -> jax.Array:
    cfg = self.config
    norm = layer_norm("norm", cfg)
    y = sublayer(norm(x) if cfg.pre_ln else x)
    y = Dropout(cfg.dropout_rate)(y, deterministic=deterministic)
    return x + y if cfg.pre_ln else norm(x + y)


class EncoderLayer(nn.Module):
  """Self-attention then feed-forward, each wrapped in `Residual`."""

  config: TransformerConfig

  @nn.compact
  def __call__(self, x: jax.Array, mask: jax.Array, deterministic: bool) -> jax.Array:
    """x: [batch, src_len, d_model]; mask: [batch, 1, src_len, src_len]."""
    cfg = self.config
    self_attn = MultiHeadAttention(cfg, name="self_attention")
    x = Residual(cfg, name="attention_block")(
      x, lambda y: self_attn(y, None, mask, deterministic), deterministic
    )
    return Residual(cfg, name="ffn_block")(x, FeedForward(cfg, name="ffn"), deterministic)


class DecoderLayer(nn.Module):
  """Masked self-attention, encoder-decoder attention (omitted when `cross_attention=False`,
  as in a decoder-only model), then feed-forward; each wrapped in `Residual`."""

  config: TransformerConfig
  cross_attention: bool = True

  @nn.compact
  def __call__(
    self,
    y: jax.Array,
    memory: jax.Array | None,
    self_mask: jax.Array | None,
    cross_mask: jax.Array | None,
    deterministic: bool,
    decode: bool = False,
    return_weights: bool = False,
  ) -> jax.Array:
    """y: [batch, tgt_len, d_model]; memory: [batch, src_len, d_model] (encoder output);
    self_mask: [batch, 1, tgt_len, tgt_len]; cross_mask: [batch, 1, tgt_len, src_len]."""
    cfg = self.config
    self_attn = MultiHeadAttention(cfg, name="self_attention")
    raw = y if decode and cfg.pre_ln and cfg.raw_self_keys else None
    y = Residual(cfg, name="self_attention_block")(
      y,
      lambda h: self_attn(h, None, self_mask, deterministic, decode, raw=raw),
      deterministic,
    )
    if self.cross_attention:
      cross = MultiHeadAttention(cfg, cross=True, name="cross_attention")
      y = Residual(cfg, name="cross_attention_block")(
        y,
        lambda h: cross(h, memory, cross_mask, deterministic, decode, return_weights),
        deterministic,
      )
    return Residual(cfg, name="ffn_block")(y, FeedForward(cfg, name="ffn"), deterministic)


def maybe_remat(layer_cls, config: TransformerConfig, static_argnums: tuple[int, ...]):
  """Wraps a layer class in `nn.remat` (recompute activations in the backward pass) when
  `config.remat` is set. `static_argnums` count `self` as argument 0."""
  if not config.remat:
    return layer_cls
  return nn.remat(layer_cls, static_argnums=static_argnums)
