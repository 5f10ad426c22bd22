"""Seeing what happened: the run's event log (events), the live console, worker lines on the
console, the leader's marks, the run log reader, incidents, ``unbroken report``'s table and the
timeline picture.

May import: :mod:`unbroken.errors` and the standard library (matplotlib and rich where drawn).
Every other package may import this one.
"""
