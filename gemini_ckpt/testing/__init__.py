"""What only the tests, the chaos harness, the demo, the benchmarks and the examples use: none of
the library's own code imports it.

- :mod:`.cluster`: :class:`~.cluster.LocalCluster`, a Ray cluster of simulated hosts on this
  machine (a lost host is a removed node), optionally each in a network namespace of its own;
- :mod:`.netns` and :mod:`.netns_node`: those namespaces, their bridge and shaped links, and a
  Ray node started inside one;
- :mod:`.commit_sim`: the commit protocol's participants run in-process, message by message,
  with deaths and losses injected;
- :mod:`.ranks`: :class:`~.ranks.TrainingRank`, the base of the tests', the chaos harness's and the
  benchmarks' training-rank actors (a gloo process group joined through the driver's
  :class:`~.ranks.Rendezvous`, a ``Checkpointer``, the teardown).
"""
