"""Errors a learner can cause, shown as one short message instead of a traceback.

IPython calls ``_render_traceback_`` when it displays an exception, so these
errors show only their message in a notebook. They are still exceptions: the
cell fails, and so does that cell under ``pytest --nbval``.
"""

RED, RESET = "\x1b[31m", "\x1b[0m"


class FriendlyError(Exception):
    """An error whose notebook display is its message alone (Chapter 0)."""

    def _render_traceback_(self) -> list[str]:
        lines = str(self).splitlines() or [type(self).__name__]
        return [f"{RED}{type(self).__name__}: {lines[0]}{RESET}", *lines[1:]]


class DoesNotFit(FriendlyError, MemoryError):
    """A tensor that would not fit in the memory left on its device (Chapter 0)."""
