"""Run-only code: what starts, supervises, throttles, retries and logs the stages, and
decides none of their bytes. No rule's code fingerprint includes it (common.fingerprint);
what of it can change a result reaches the result keys as data (docs/invalidation.md)."""
