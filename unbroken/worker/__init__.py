"""The worker's runtime: the :class:`~unbroken.worker.runtime.Job` and its steps, joining
generations, healing, the gradient allreduce, the generation's process groups, the default group
that libraries see, leader-only calls, mixed precision, devices and NCCL, fault injection.

May import: :mod:`unbroken.errors`, :mod:`unbroken.store_keys`, :mod:`unbroken.open_files`,
:mod:`unbroken.observe`, :mod:`unbroken.data`, :mod:`unbroken.replica_groups`,
:mod:`unbroken.storage`, :mod:`unbroken.coordinator` (its client and records only).
"""
