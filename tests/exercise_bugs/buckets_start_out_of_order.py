"""Planted bug: every complete bucket starts at once, without waiting for the buckets before it.

exercise: 3.1
file: buckets.py
expect: bucket 2 is complete, but starting it now is out of order: bucket 0 has not started
"""


def buckets_to_start(missing, started, bucket):
    missing[bucket] -= 1
    return [bucket] if missing[bucket] == 0 else []  # the bug: bucket `started` must be complete first
