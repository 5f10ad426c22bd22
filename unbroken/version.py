"""unbroken's version, in a module of its own: the modules that record it (checkpoint manifests,
the join's version check) read it without importing the package's public names."""

__version__ = "0.1.0"
