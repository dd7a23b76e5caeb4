"""Saving a version on the trainer: the snapshot plan (:mod:`.plan`, with DCP's planner and
:mod:`.chunks`), where each item's bytes come from (:mod:`.sources`, :mod:`.checked`), the staging
copy into store-owned memory (:mod:`.stager`, :mod:`.overlap`) and the DCP file templates
(:mod:`.templates`). The bytes' layout is :mod:`gemini_ckpt.format`'s. Importing this package
imports nothing.
"""
