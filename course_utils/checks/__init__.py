"""Exercise checkers, one module per chapter: ``course_utils.checks.chNN``."""
