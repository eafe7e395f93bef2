"""The one exception type the runtime raises for failures outside the caller's arguments."""


class KVStoreError(RuntimeError):
    """A distributed operation failed: a peer died, a deadline passed, a server refused a request.

    Bad arguments raise ``ValueError`` / ``TypeError`` / ``KeyError`` instead, before anything
    is sent.
    """
