"""Integrations with other frameworks, each a module of its own (Ray Train: :mod:`.ray_train`)."""
