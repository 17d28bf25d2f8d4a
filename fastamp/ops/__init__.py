"""The op layer: what every optimizer and the scaler call, one stage below them.

- :mod:`fastamp.ops.registry`: the op table (schemas, which backend has which op, the native
  library's load state) -- the only list of ops.
- :mod:`fastamp.ops.backends`: picking a backend and the (op, backend) -> callable map
  (public as ``fastamp.backends``).
- :mod:`fastamp.ops.functional`: the checked functional ops (public as ``fastamp.functional``).
- :mod:`fastamp.ops.validate`: the user-facing argument checks that ``functional`` runs.
"""
