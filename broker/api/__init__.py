"""The HTTP API: the native v1 routes, and the layers every door shares (error mapping, size
guards and connection limits, security headers, OpenAPI schemas), one module each.

The package imports none of them itself, so that a module importing one layer does not load the
native routes with it.
"""

__all__: list[str] = []
