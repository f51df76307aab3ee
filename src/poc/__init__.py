"""poc: a proof-of-compute engine and server for the Gonka network (PoC v1 and v2)."""

__version__ = "0.1.0"
