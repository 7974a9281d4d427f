"""Stand-in for transformers' `tests/generation/test_utils.py`, which is in its git repository only (see the
package docstring): `test_modeling_common.py` imports `GenerationTesterMixin` from here. It adds no tests."""


class GenerationTesterMixin:
    pass
