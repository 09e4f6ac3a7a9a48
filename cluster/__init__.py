"""A job of several processes (hosts): joining it, and stopping every process when one is lost.

`distributed.py` joins the job and watches it (heartbeats in the coordination service's key-value
store); `coordinator.py` runs JAX's coordination service in a child of process 0 and probes a
coordinator's port; `jax_private.py` and `orbax_private.py` are the only modules that touch JAX's
and Orbax's private names, each with the public API that is missing. The package needs only
core/, JAX and Orbax: training/ calls it, and the command line owns how the process ends
(core/ending.py).
"""
