"""Update rules, one module each: the public optimizer class, its hyperparameter checks, its
step scalars and its state keys (:class:`~fastamp.optim.rules.adamw.AdamW`,
:class:`~fastamp.optim.rules.sgd.SGD`, :class:`~fastamp.optim.rules.lion.Lion`)."""
