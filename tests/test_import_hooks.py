"""`import_hooks.call_when_imported`: registrations with PEFT and Liger that wait for the package's import."""

import sys

import pytest

from modeling_diff.import_hooks import call_when_imported


@pytest.fixture
def package(tmp_path, monkeypatch):
    """A package `late_pkg` with a module `late_pkg.table` (a dict TABLE) on sys.path, not imported yet."""
    (tmp_path / "late_pkg").mkdir()
    (tmp_path / "late_pkg" / "__init__.py").write_text("")
    (tmp_path / "late_pkg" / "table.py").write_text("TABLE = {'llama': 1}\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "late_pkg.table"
    for name in ("late_pkg.table", "late_pkg"):
        sys.modules.pop(name, None)


def test_a_callback_runs_once_right_after_the_module_s_code(package):
    calls = []

    def register():  # what register_peft_default_targets does: the module's dict, as its code left it
        table = sys.modules[package].TABLE
        calls.append(dict(table))
        table.setdefault("diff_llama", table["llama"])

    call_when_imported(package, register)
    call_when_imported(package, register)  # every model asks as it is built: one registration
    assert calls == [] and package not in sys.modules  # asking imports nothing
    from late_pkg.table import TABLE

    assert calls == [{"llama": 1}] and TABLE == {"llama": 1, "diff_llama": 1}
    call_when_imported(package, register)  # imported: at once
    assert len(calls) == 2


def test_a_failing_callback_warns_and_the_import_goes_on(package):
    def broken():
        raise KeyError("llama")

    call_when_imported(package, broken)
    with pytest.warns(UserWarning, match=r"could not register with late_pkg\.table: KeyError"):
        import late_pkg.table
    assert late_pkg.table.TABLE == {"llama": 1}
