"""``unbroken run``: the launcher and its worker processes, its settings and flags (torchrun's
spellings included), placement under SLURM, the embedded coordinator and etcd members, restart
budgets, and the demo.

May import every package but :mod:`unbroken.integrations`.
"""
