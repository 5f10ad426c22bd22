"""The coordinator: membership and generations (membership, liveness, member records, roster),
its HTTP API and server, leadership among candidates over etcd (leading, replicated), its
Prometheus metrics, and the client that members and launchers talk to it with.

May import: :mod:`unbroken.errors`, :mod:`unbroken.store_keys`, :mod:`unbroken.open_files`,
:mod:`unbroken.observe`. Importing this package is light: ``Coordinator`` and
``CoordinatorSettings`` (the former ``unbroken.coordinator`` module's names) load the server on
first use.
"""

from typing import Any


def __getattr__(name: str) -> Any:
    if name in ("Coordinator", "CoordinatorSettings"):
        from unbroken.coordinator import server

        return getattr(server, name)
    raise AttributeError(f"module 'unbroken.coordinator' has no attribute {name!r}")
