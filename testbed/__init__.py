"""What the tests and the benchmarks share: starting unbroken jobs and coordinators, waiting on
conditions with a bound, ending every process they started (:mod:`testbed.harness`, with the
invariant checks every multi-process test ends with), etcd clusters (:mod:`testbed.etcd`),
network-namespace hosts (:mod:`testbed.netns`), spawned children (:mod:`testbed.processes`) and
the training scripts they run (``testbed/scripts/``).

Both ``tests/`` and ``benchmarks/`` import from here; this package imports neither, and it needs
no pytest. It is not shipped with the ``unbroken`` package.
"""
