"""The durable tier: every Nth committed version written through ``pyarrow.fs`` (or a registered
backend) as a standard DCP checkpoint.

:mod:`.backends` names a filesystem by URI scheme (where a new backend goes); :mod:`.layout` is the
on-disk layout and its atomic commit (``latest`` last), torch-free so host stores use it too;
:mod:`.files` and :mod:`.fs` read and write it without following what we did not write;
:mod:`.tier` is the tier restore and retention read; :mod:`.writer` persists a memory version.
Importing this package imports nothing.
"""
