"""Why a load failed, as a type: one FailureCause per failed load, set where the exception is caught
(window loop, restore, retrieve, loader, commit) and carried on the load's record (retrieve.LoadRecord, each
tier tried: Attempt and its RestoreReport; the worker's report of it under "cause"). Metrics labels and tier
health read it; nothing reads an error's message to decide anything (a reworded message changes no
label, a subclass of a tier error keeps its class's cause).

    corrupt      an object failed its integrity check (CorruptObjectError)
    missing      an object was not there (MissingObjectError; HostLostError: its store host is lost), or no
                 tier held the complete prefix
    timeout      a tier's read missed its deadline (FetchTimeoutError)
    unavailable  the tier could not be reached (TierUnavailableError), or was skipped in its cooldown
    staging      no staging for a window within the wait's bound (StagingWaitTimeout: the byte budget B
                 is held by other loads or lost behind reads that never landed; StagingExhausted: lost,
                 and the loader replaces its staging no more), or a whole plan past the staging
                 capacity. Not `timeout`: that one says a tier is slow, this one that B is too small or
                 stuck, and the fix differs
    cancelled    the request was aborted (or the engine shut down) while it restored
    commit_rule  this rank restored its part, another rank or group did not (its own cause is on its record)
    agreement    the ranks reached no decision (AgreementFailed, or the agreement raised)
    bad_input    the load's own input was refused (ValueError: block tables, token counts, destinations)
    other        anything else (an install exception, a bug); the error text says what
"""

from __future__ import annotations

import enum

from bsr_kernels.staging_arena import StagingArenaRetired, StagingExhausted, StagingWaitCancelled, StagingWaitTimeout

from .commit import AgreementFailed
from .tiers.base import CorruptObjectError, FetchTimeoutError, MissingObjectError, TierUnavailableError
from .window_loop import RestoreCancelled, WindowFailed


class FailureCause(str, enum.Enum):
    """A failed load's cause; its value is the metrics label."""

    CORRUPT = "corrupt"
    MISSING = "missing"
    TIMEOUT = "timeout"
    UNAVAILABLE = "unavailable"
    STAGING = "staging"
    CANCELLED = "cancelled"
    COMMIT_RULE = "commit_rule"
    AGREEMENT = "agreement"
    BAD_INPUT = "bad_input"
    OTHER = "other"

    def __str__(self) -> str:
        return self.value


# exception class -> cause, most specific first (the first isinstance match wins)
_BY_TYPE: tuple[tuple[type[BaseException], FailureCause], ...] = (
    (CorruptObjectError, FailureCause.CORRUPT),
    (MissingObjectError, FailureCause.MISSING),
    (FetchTimeoutError, FailureCause.TIMEOUT),
    (TierUnavailableError, FailureCause.UNAVAILABLE),
    (StagingWaitTimeout, FailureCause.STAGING),
    (StagingExhausted, FailureCause.STAGING),
    (StagingArenaRetired, FailureCause.STAGING),
    (StagingWaitCancelled, FailureCause.CANCELLED),
    (RestoreCancelled, FailureCause.CANCELLED),
    (AgreementFailed, FailureCause.AGREEMENT),
    (ValueError, FailureCause.BAD_INPUT),
)


def cause_of(error: BaseException) -> FailureCause:
    """The cause of a caught exception, by its class (a failed window: by what failed it)."""
    if isinstance(error, WindowFailed):
        error = error.cause
    for kind, cause in _BY_TYPE:
        if isinstance(error, kind):
            return cause
    return FailureCause.OTHER
