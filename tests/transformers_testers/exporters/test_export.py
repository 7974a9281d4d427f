"""Stand-in for transformers' `tests/exporters/test_export.py`, which is in its git repository only (see the
package docstring): `ModelTesterMixin` derives from `ExportTesterMixin`. It adds no tests."""


class ExportTesterMixin:
    pass
