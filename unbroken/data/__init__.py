"""What each member trains on: the data plan (a step's global batch split into micro-batches),
the loader that reads the plan's samples exactly once, shards and random windows.

May import: :mod:`unbroken.errors`. Imported by the worker, replica groups and storage.
"""
