"""The package's version: one line that setup.py, the metrics file and the extension read."""

__version__ = "0.1.0"
