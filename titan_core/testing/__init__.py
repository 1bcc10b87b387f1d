"""Servers that tests and benchmarks share: a local S3 (``s3``) and free ports (``ports``).

Public so that a script outside the test suite (``bench/``) imports them the same way the tests
do; nothing in the engine imports this package.
"""
