"""dtrain: distributed deep-learning training from scratch, on NumPy and MPI, for learning how it really works."""

__version__ = "0.1.0"
