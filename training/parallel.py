"""Turns the single-device step into a multi-device one, and sets up multi-host jobs.

'pmap': data parallel. The state is replicated (a leading device axis), each local device gets
  `rows / devices` rows, and `train_step` sums gradients with `lax.psum` over the axis 'batch'.
  Simple and robust; every device holds the whole model and optimizer state.
'mesh': `jax.jit` over a `Mesh(data, fsdp, tensor)`. The batch is split over data × fsdp; each
  parameter (and its Adam moments) is sharded by its logical axis names through LOGICAL_RULES:
  `embed` over fsdp (ZeRO-3 style), `heads`/`mlp`/`vocab` over tensor (Megatron style). Choose it
  when the model or optimizer state does not fit one device, or to combine data and model
  parallelism; with fsdp = tensor = 1 it is plain data parallelism.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import numpy as np
from absl import logging
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from training.state import TrainState

AXIS = "batch"  # pmap's axis name
MESH_AXES = ("data", "fsdp", "tensor")
# Logical axis name -> mesh axes (MaxText-style rules). None = replicated.
LOGICAL_RULES = (
  ("batch", ("data", "fsdp")),
  ("length", None),
  ("embed", "fsdp"),
  ("vocab", "tensor"),
  ("heads", "tensor"),
  ("mlp", "tensor"),
  ("kv", None),
)


# ----------------------------------------------------------------------------- devices
def local_devices(config) -> list:
  """This process's devices, or its first `config.num_devices` of them."""
  devices = jax.local_devices()
  n = int(config.get("num_devices", 0) or 0)
  if n < 0 or n > len(devices):
    raise ValueError(f"config error: num_devices={n}, but this process has {len(devices)} devices")
  return devices[:n] if n else devices


def global_devices(config) -> list:
  """The devices of all processes that take part (`num_devices` of each)."""
  n = int(config.get("num_devices", 0) or 0)
  if not n:
    return jax.devices()
  local_count = jax.local_device_count()
  if n < 0 or n > local_count:
    raise ValueError(f"config error: num_devices={n}, but this process has {local_count} devices")
  by_process = {}
  for d in jax.devices():
    by_process.setdefault(d.process_index, []).append(d)
  return [d for p in sorted(by_process) for d in by_process[p][:n]]


def data_parallel_size(config) -> int:
  """How many ways the global batch is split under config.parallelism."""
  if config.parallelism == "pmap":
    return len(local_devices(config)) * jax.process_count()
  if config.parallelism == "mesh":
    mesh = make_mesh(config.mesh, global_devices(config))
    return mesh.shape["data"] * mesh.shape["fsdp"]
  raise ValueError(f"config error: parallelism={config.parallelism!r}; valid: pmap, mesh")


# ----------------------------------------------------------------------------- mesh
def make_mesh(mesh_cfg, devices=None) -> Mesh:
  """A Mesh with axes (data, fsdp, tensor); one size may be -1 = the remaining devices."""
  devices = list(devices if devices is not None else jax.devices())
  n = len(devices)
  sizes = {a: int(mesh_cfg[a]) for a in MESH_AXES}
  free = [a for a, s in sizes.items() if s == -1]
  if len(free) > 1:
    raise ValueError(f"config error: only one of mesh.data/fsdp/tensor may be -1, got {sizes}")
  if any(s == 0 or s < -1 for s in sizes.values()):
    raise ValueError(f"config error: mesh sizes must be positive or -1, got {sizes}")
  known = math.prod(s for s in sizes.values() if s != -1)
  if free:
    if n % known:
      raise ValueError(
        f"config error: {n} devices cannot be split into mesh {sizes}: "
        f"{n} is not divisible by {known}"
      )
    sizes[free[0]] = n // known
  if math.prod(sizes.values()) != n:
    raise ValueError(
      f"config error: mesh.data × mesh.fsdp × mesh.tensor = "
      f"{sizes['data']} × {sizes['fsdp']} × {sizes['tensor']} = "
      f"{math.prod(sizes.values())}, but there are {n} devices"
    )
  grid = np.asarray(devices).reshape(sizes["data"], sizes["fsdp"], sizes["tensor"])
  return Mesh(grid, MESH_AXES)


def _axes(entry) -> tuple:
  """A PartitionSpec entry as a tuple of mesh axis names (None -> ())."""
  return () if entry is None else (entry if isinstance(entry, tuple) else (entry,))


def _fit_spec(spec: P, shape: tuple[int, ...], mesh: Mesh) -> P:
  """Drops mesh axes from dimensions they do not divide (e.g. a vocabulary of 8003 over 2)."""
  out = []
  for dim, axes in zip(shape, tuple(spec) + (None,) * (len(shape) - len(spec))):
    size = math.prod(mesh.shape[a] for a in _axes(axes))
    out.append(axes if dim % size == 0 else None)
  return P(*out)


def state_shardings(abstract_boxed_state, mesh: Mesh):
  """NamedShardings for every leaf of the (unboxed) state, from the parameters' logical axes.
  A mesh axis that does not divide a dimension leaves it replicated; that is logged (except for
  the vocabulary, whose size is rarely a multiple), as is an fsdp or tensor axis that shards no
  parameter at all: its devices then hold and compute copies."""
  logical = nn.get_partition_spec(abstract_boxed_state)
  mesh_specs = nn.logical_to_mesh(logical, LOGICAL_RULES)
  unboxed = nn.unbox(abstract_boxed_state)
  dropped, used = [], set()

  def fit(path, names, spec, leaf):
    fitted = _fit_spec(spec, leaf.shape, mesh)
    pad = (None,) * leaf.ndim
    for dim, name, want, got in zip(
      leaf.shape, tuple(names) + pad, tuple(spec) + pad, tuple(fitted) + pad
    ):
      used.update(a for a in _axes(got) if mesh.shape[a] > 1)
      lost = [a for a in _axes(want) if mesh.shape[a] > 1 and a not in _axes(got)]
      if lost and name != "vocab" and "params" in jax.tree_util.keystr(path):
        dropped.append(f"{jax.tree_util.keystr(path)} {name}={dim} over {'×'.join(lost)}")
    return NamedSharding(mesh, fitted)

  shardings = jax.tree_util.tree_map_with_path(
    fit, logical, mesh_specs, unboxed, is_leaf=lambda x: isinstance(x, P)
  )
  if dropped:
    logging.warning(
      "mesh %s does not divide %d parameter dimension(s), which stay replicated "
      "(no memory saved on them): %s%s",
      dict(mesh.shape),
      len(dropped),
      "; ".join(dropped[:4]),
      " ..." if len(dropped) > 4 else "",
    )
  for axis in ("fsdp", "tensor"):
    if mesh.shape[axis] > 1 and axis not in used:
      logging.warning(
        "mesh.%s=%d shards no parameter (model.num_heads, d_ff or d_model not "
        "divisible by it?): its devices hold and compute copies",
        axis,
        mesh.shape[axis],
      )
  return shardings


def batch_sharding(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, P(("data", "fsdp")))


# ----------------------------------------------------------------------------- the wrappers
@dataclasses.dataclass
class Parallel:
  """One parallelism scheme: the compiled steps and how the state and batches are placed. The
  training loop, evaluation and checkpoints use only these, never `kind`.

  Attributes:
    kind: 'pmap' or 'mesh'.
    data_parallel: how many ways the global batch is split (its row count must divide by it).
    devices: the devices the step runs on (every process's).
    train_step: (state, batch, rng) -> (state, metrics), on placed state and host batches.
    eval_step: (params, batch) -> summed metrics.
    init_state: rng -> a fresh placed state.
    abstract_state: the state's shapes and dtypes (unboxed ShapeDtypeStructs), one model copy.
    restore_target: `abstract_state` with the shardings a checkpoint is restored into.
    from_restored: a state restored into `restore_target` -> the state the step takes.
    to_checkpoint: the step's state -> what a checkpoint stores (one model copy).
    decoding_params: the step's state -> parameters `model.generate` can decode with.
    place_state: a host state (numpy) -> the state the step takes.
    place_batch: a host batch -> the batch the compiled step takes.
    host_state: the step's state -> one copy of it on this host (numpy).
    state_sharding: the state's shardings under 'mesh' (None under 'pmap').
    mesh: the Mesh under 'mesh' (None under 'pmap').
  """

  kind: str
  data_parallel: int
  devices: list
  train_step: Callable
  eval_step: Callable
  init_state: Callable[[Any], Any]
  abstract_state: Any
  restore_target: Any
  from_restored: Callable[[Any], Any]
  to_checkpoint: Callable[[Any], Any]
  decoding_params: Callable[[Any], Any]
  place_state: Callable[[Any], Any]
  place_batch: Callable[[dict], Any]
  host_state: Callable[[Any], Any]
  state_sharding: Any = None
  mesh: Mesh | None = None


def _with_sharding(abstract, shardings):
  """ShapeDtypeStructs of `abstract` carrying `shardings` (one sharding, or a tree of them)."""
  if not isinstance(shardings, jax.sharding.Sharding):
    return jax.tree_util.tree_map(
      lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), abstract, shardings
    )
  return jax.tree_util.tree_map(
    lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=shardings), abstract
  )


def _check_rows(batch, multiple, kind):
  rows = next(iter(batch.values())).shape[0]
  if rows % multiple:
    raise ValueError(
      f"{kind}: the batch has {rows} rows on this process, not divisible by "
      f"the {multiple} local data-parallel devices"
    )


def build(
  kind: str,
  config,
  *,
  init_fn: Callable[[jax.Array], TrainState],
  train_step: Callable,
  eval_step: Callable,
) -> Parallel:
  """Wraps `train_step(state, batch, rng, axis_name=...)` and `eval_step(params, batch,
  axis_name=...)` for `kind` ('pmap' or 'mesh') on all devices of all processes.

  `init_fn(rng) -> TrainState` builds the state with boxed (logically annotated) parameters.
  """
  abstract = jax.eval_shape(init_fn, jax.random.key(0))
  unboxed_init = lambda rng: nn.unbox(init_fn(rng))
  if kind == "pmap":
    return _build_pmap(
      abstract, unboxed_init, train_step, eval_step, local_devices(config), global_devices(config)
    )
  if kind == "mesh":
    return _build_mesh(config, abstract, unboxed_init, train_step, eval_step)
  raise ValueError(f"config error: parallelism={kind!r}; valid: pmap, mesh")


def _build_pmap(abstract, init_fn, train_step, eval_step, devices, all_devices) -> Parallel:
  """`devices`: this process's; `all_devices`: every process's (the pmap axis spans them all, so
  `psum` sums over the whole job)."""
  n = len(devices)
  p_train = jax.pmap(
    functools.partial(train_step, axis_name=AXIS),
    axis_name=AXIS,
    in_axes=(0, 0, None),
    donate_argnums=(0,),
    devices=all_devices,
  )
  p_eval = jax.pmap(
    functools.partial(eval_step, axis_name=AXIS), axis_name=AXIS, devices=all_devices
  )

  replicated = NamedSharding(Mesh(np.asarray(devices), (AXIS,)), P(AXIS))

  def place_state(state):
    """Host state -> one copy per device along a new leading axis (pmap's layout)."""

    def put(x):
      x = np.asarray(x)
      return jax.make_array_from_callback((n, *x.shape), replicated, lambda idx: x[None])

    return jax.tree_util.tree_map(put, jax.device_get(state))

  def place_batch(batch):
    _check_rows(batch, n, "pmap")
    return {k: v.reshape(n, v.shape[0] // n, *v.shape[1:]) for k, v in batch.items()}

  def first(x):
    """One replica, read from this process's first device. `x[0]` on an array spread over
    several processes is a computation every process must join: a two-process pmap job hung
    there at its final checkpoint (process 1 inside `x[0]`, process 0 already in Orbax's
    barrier). The replicas are equal, so any local one will do."""
    return x.addressable_shards[0].data[0]

  def host_state(state):
    return jax.device_get(jax.tree_util.tree_map(first, state))

  def train(state, batch, rng):
    state, metrics = p_train(state, place_batch(batch), rng)
    return state, jax.tree_util.tree_map(first, metrics)

  def evaluate(params, batch):
    return jax.tree_util.tree_map(first, p_eval(params, place_batch(batch)))

  def init(rng):
    return place_state(jax.jit(init_fn)(rng))

  unboxed = nn.unbox(abstract)
  one_device = jax.sharding.SingleDeviceSharding(devices[0])
  return Parallel(
    kind="pmap",
    data_parallel=n * jax.process_count(),
    devices=list(all_devices),
    train_step=train,
    eval_step=evaluate,
    init_state=init,
    abstract_state=unboxed,
    # Restored onto one device, then replicated along pmap's leading axis.
    restore_target=_with_sharding(unboxed, one_device),
    from_restored=place_state,
    to_checkpoint=host_state,
    decoding_params=lambda state: host_state(state).params,
    place_state=place_state,
    place_batch=place_batch,
    host_state=host_state,
  )


def _build_mesh(config, abstract, init_fn, train_step, eval_step) -> Parallel:
  mesh = make_mesh(config.mesh, global_devices(config))
  shardings = state_shardings(abstract, mesh)
  data_sharding = batch_sharding(mesh)
  replicated = NamedSharding(mesh, P())
  dp = mesh.shape["data"] * mesh.shape["fsdp"]
  if dp % jax.process_count():
    raise ValueError(
      f"config error: mesh data×fsdp = {dp} must be a multiple of the "
      f"{jax.process_count()} processes"
    )
  j_train = jax.jit(
    train_step,
    in_shardings=(shardings, data_sharding, replicated),
    out_shardings=(shardings, replicated),
    donate_argnums=(0,),
  )
  j_eval = jax.jit(
    eval_step, in_shardings=(shardings.params, data_sharding), out_shardings=replicated
  )
  j_init = jax.jit(init_fn, out_shardings=shardings)

  def place_state(state):
    return jax.tree_util.tree_map(
      lambda x, s: jax.make_array_from_callback(np.shape(x), s, lambda idx: np.asarray(x)[idx]),
      jax.device_get(state),
      shardings,
    )

  def place_batch(batch):
    local_dp = dp // jax.process_count()
    rows = next(iter(batch.values())).shape[0]
    if rows % local_dp:
      raise ValueError(
        f"mesh: the batch has {rows} rows on this process, not divisible by its "
        f"share of the data-parallel mesh axes (data×fsdp={dp} over "
        f"{jax.process_count()} processes = {local_dp})"
      )
    return {k: jax.make_array_from_process_local_data(data_sharding, v) for k, v in batch.items()}

  def host_state(state):
    if jax.process_count() > 1:
      return multihost_utils.process_allgather(state, tiled=True)
    return jax.device_get(state)

  def train(state, batch, rng):
    return j_train(state, place_batch(batch), rng)

  def evaluate(params, batch):
    return j_eval(params, place_batch(batch))

  unboxed = nn.unbox(abstract)
  logging.info("mesh %s; parameters sharded by %s", dict(mesh.shape), LOGICAL_RULES)
  return Parallel(
    kind="mesh",
    data_parallel=dp,
    devices=list(mesh.devices.flat),
    train_step=train,
    eval_step=evaluate,
    init_state=j_init,
    abstract_state=unboxed,
    # Restored straight into this run's shardings, whatever the devices that saved it.
    restore_target=_with_sharding(unboxed, shardings),
    from_restored=lambda state: state,
    to_checkpoint=lambda state: state,
    decoding_params=lambda state: state.params,
    place_state=place_state,
    place_batch=place_batch,
    host_state=host_state,
    state_sharding=shardings,
    mesh=mesh,
  )
