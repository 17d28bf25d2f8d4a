"""State formats: how a moment or a master weight is stored, and its bytes per param.

- :mod:`~fastamp.optim.formats.moments`: fp32 / bf16 / q8 moment formats.
- :mod:`~fastamp.optim.formats.masters`: master-weight kinds (fp32, int16 remainder, ulp8,
  stochastic rounding, none).
"""
