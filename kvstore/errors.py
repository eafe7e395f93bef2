"""The one exception family the runtime raises for failures outside the caller's arguments,
and the exit codes that tell a platform (Kubernetes, Slurm, a script) whether to retry.

Permanent errors exit 1-127: running the process again fails the same way (a Kubernetes
``podFailurePolicy`` fails the job on them). Transient ones exit 128 or more: a peer was lost
or a deadline passed while the cluster was coming up, so a fresh start may succeed.

=====  ==================  ==========================================================
code   name                meaning
=====  ==================  ==========================================================
0                          the job finished
1      EXIT_FAILED         an error of the job itself (a refused request, a deadlock,
                           a port in use, an uncaught exception in a worker)
2      EXIT_CONFIG         bad configuration (a DMLC_* / KVSTORE_* variable)
3      EXIT_AUTH           refused authentication (another job's KVSTORE_SECRET)
129    EXIT_PEER_LOST      a peer lost, the scheduler gone or never resolved, start-up
                           deadline passed: retry
=====  ==================  ==========================================================

>>> PeerLostError("server 1 died").exit_code
129
"""

EXIT_FAILED = 1
EXIT_CONFIG = 2
EXIT_AUTH = 3
EXIT_PEER_LOST = 129


class KVStoreError(RuntimeError):
    """A distributed operation failed: a peer died, a deadline passed, a server refused a request.

    Bad arguments raise ``ValueError`` / ``TypeError`` / ``KeyError`` instead, before anything
    is sent. :attr:`exit_code` is the status a process ending with this error exits with.
    """

    exit_code = EXIT_FAILED


class PeerLostError(KVStoreError):
    """A node of the job died or stopped answering, the scheduler could not be reached (or its
    name resolved) before the start-up deadline, or the scheduler ended the job: transient."""

    exit_code = EXIT_PEER_LOST


class AuthError(KVStoreError):
    """The scheduler refused this process's key: the job secrets differ. Permanent."""

    exit_code = EXIT_AUTH


class ConfigError(ValueError):
    """A bad setting in the environment (``kvstore.config``): permanent."""

    exit_code = EXIT_CONFIG


def exit_code_of(exc: BaseException) -> int:
    """The exit status for a process that ends with ``exc``: its ``exit_code`` when it has
    one, else 1."""
    code = getattr(exc, "exit_code", EXIT_FAILED)
    return code if isinstance(code, int) and 0 < code < 256 else EXIT_FAILED
