"""Durable state: checkpoints (whole and sharded, written in the background, anywhere fsspec
reaches), the copies they are made from, and the restricted unpickler that reads them.

May import: :mod:`unbroken.errors`, :mod:`unbroken.observe`, :mod:`unbroken.data`,
:mod:`unbroken.replica_groups`.
"""
