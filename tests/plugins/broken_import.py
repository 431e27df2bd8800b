"""Example of a plugin that cannot be imported (a dependency it needs is missing)."""

import loramux_dependency_that_is_not_installed  # noqa: F401
