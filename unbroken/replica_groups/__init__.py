"""Replica groups: K processes that shard one replica (FSDP) and are one member of the job.

:mod:`~unbroken.replica_groups.sharding` holds the pure pieces (group shapes, the local shards of
gradients and state, and, from :mod:`~unbroken.replica_groups.process_plan`, the data plan split
for groups); :mod:`~unbroken.replica_groups.group_relay` passes what process 0 hears from the
coordinator on to the others. The worker's side of a group
(``group_mesh()``, its process group, watchdog and votes) is :mod:`unbroken.worker.group_member`.

May import: :mod:`unbroken.errors`, :mod:`unbroken.store_keys`, :mod:`unbroken.data`,
:mod:`unbroken.observe`.
"""

from unbroken.replica_groups.sharding import *  # noqa: F401,F403  (the names of the former unbroken.replica_groups module)
from unbroken.replica_groups.sharding import __all__  # noqa: F401
