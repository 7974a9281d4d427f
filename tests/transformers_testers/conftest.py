# Nothing in this package is a test of ours: transformers' mixins run only through tests/test_transformers_mixins.py.
collect_ignore_glob = ["*.py", "*/*.py"]
