"""A user's module that fails on import."""

import this_package_does_not_exist  # noqa: F401
