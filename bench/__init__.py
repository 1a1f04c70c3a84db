"""pyembed's benchmark harness (``python -m bench`` / ``make bench``)."""
