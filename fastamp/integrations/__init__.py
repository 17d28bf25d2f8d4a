"""Adapters that make fastamp work inside training frameworks.

Each submodule imports its framework when it is imported itself, never before:
``import fastamp`` (and ``import fastamp.integrations``) imports neither Lightning nor
Accelerate.

* :mod:`fastamp.integrations.lightning`: ``MixedPrecision``, a Lightning precision plugin
  on :class:`fastamp.Scaler` with fused gradient clipping for amp-aware optimizers.
* :mod:`fastamp.integrations.accelerate`: :func:`~fastamp.integrations.accelerate.use_fastamp_scaler`,
  which puts a :class:`fastamp.Scaler` into a Hugging Face ``Accelerator`` (also the one
  ``transformers.Trainer`` builds).
"""
