"""Model backends: each wraps one model as a :class:`~specdec.backends.base.ModelRunner`."""
