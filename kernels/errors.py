"""The one exception the kernels raise. Kept apart from _checks.py (which needs torch) so that
tierkv.errors can build on it without importing torch: a bad flag to tierkv-serve fails before
torch loads. Imports nothing.
"""


class ShapeError(ValueError):
    """A tensor handed to a kernel has the wrong shape, dtype or device (tierkv.errors.ShapeError,
    which the cache raises, derives from it: catching this catches both)."""
