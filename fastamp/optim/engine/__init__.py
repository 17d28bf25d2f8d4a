"""The optimizer engine: one driver for every update rule and state format.

- :mod:`~fastamp.optim.engine.base`: :class:`FusedOptimizer` (validate, plan, run; ``step``,
  ``step_bucket``, ``bucket_step``).
- :mod:`~fastamp.optim.engine.plan`: the persistent per-step plan and its steady-state checks.
- :mod:`~fastamp.optim.engine.context`: the step context, a grad scaler's ``grad_scale`` /
  ``found_inf`` and what every launch of a step derives from them (eager and compiled alike).
- :mod:`~fastamp.optim.engine.traced`: the compiled step (dynamo glue; same kernels as eager).
- :mod:`~fastamp.optim.engine.checks`: hyperparameter and state checks shared by the rules.
- :mod:`~fastamp.optim.engine.rng`: the per-group random counter for stochastic rounding.
- :mod:`~fastamp.optim.engine.state_dict`, :mod:`~fastamp.optim.engine.steps`: export/import
  of state, per-param step counts.
"""
