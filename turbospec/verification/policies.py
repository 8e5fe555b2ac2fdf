"""Names of the acceptance policies and what each needs (no torch import: config and the server read these).
The policies themselves are in lossy.py."""

from __future__ import annotations

ACCEPTANCE_POLICIES = ("exact", "typical", "adasd", "adasd-generation", "adasd-verification")
LOSSLESS_POLICIES = ("exact", "adasd-generation")  # adasd-generation only shortens drafts
# policies that read the draft model's distribution (and so need a draft model, not n-gram lookup)
DRAFT_DISTRIBUTION_POLICIES = ("adasd", "adasd-generation", "adasd-verification")
STOPS_DRAFTING = ("adasd", "adasd-generation")
RELAXES_JS = ("adasd", "adasd-verification")
# speculative methods whose proposer is a model sampling each draft token (it has a distribution to read)
DISTRIBUTION_METHODS = ("draft", "layer-skip")
TYPICAL_EPSILON = 0.09  # Medusa's defaults
TYPICAL_DELTA = 0.3


def check_policy(policy: str, method: str | None) -> str:
    """Validate a policy name for a speculative method; returns it."""
    if policy not in ACCEPTANCE_POLICIES:
        raise ValueError(f"unknown acceptance policy {policy!r}: expected one of {', '.join(ACCEPTANCE_POLICIES)}")
    if policy in DRAFT_DISTRIBUTION_POLICIES and method not in DISTRIBUTION_METHODS:
        raise ValueError(f"acceptance {policy!r} reads the draft model's distribution: it needs speculative method "
                         f"{' or '.join(map(repr, DISTRIBUTION_METHODS))} (this engine's is {method!r}); 'typical' "
                         f"and 'exact' work with any proposer")
    return policy
