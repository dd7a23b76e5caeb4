"""Saving a version: the snapshot plan, staging into store-owned memory, and the DCP file layout.

The trainer's side (:mod:`.plan`, :mod:`.sources`, :mod:`.stager`, :mod:`.templates`,
:mod:`.dcp`) imports torch; :mod:`.framing` (how a shard is laid out as DCP's
``FileSystemWriter`` file, from its raw bytes) does not, so host stores can persist without
torch. Importing this package imports nothing.
"""
