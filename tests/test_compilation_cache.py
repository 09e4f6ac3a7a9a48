"""Where inference/compilation_cache.py puts JAX's persistent compilation cache (decode.py's
second run compiling nothing is tested in tests/test_decode.py)."""

import pathlib

from inference import compilation_cache


def test_the_folder_is_the_flag_then_jax_s_variable_then_the_user_s_cache():
  home = str(pathlib.Path("~").expanduser())
  assert compilation_cache.folder(None, {}) == pathlib.Path(home, ".cache/attention-jax/jax")
  xdg = {"XDG_CACHE_HOME": "/x"}
  assert compilation_cache.folder(None, xdg) == pathlib.Path("/x/attention-jax/jax")
  jax_own = {**xdg, "JAX_COMPILATION_CACHE_DIR": "/j"}
  assert compilation_cache.folder(None, jax_own) == pathlib.Path("/j")
  assert compilation_cache.folder("/f", jax_own) == pathlib.Path("/f")
  for off in ("off", "OFF", "none", ""):
    assert compilation_cache.folder(off, jax_own) is None
  assert compilation_cache.folder(None, {"JAX_COMPILATION_CACHE_DIR": ""}) is None
