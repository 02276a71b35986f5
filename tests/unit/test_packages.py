"""``reroll.packages.importable``: the one "is it installed" test, dotted names included."""

from reroll.engines import engine_available
from reroll.packages import importable


def test_a_module_whose_parent_package_is_missing_is_not_importable_rather_than_an_error():
    assert importable("json") and importable("reroll.engines.hf")
    assert not importable("reroll_no_such_package")
    assert not importable("reroll_no_such_package.sub")  # find_spec raises ModuleNotFoundError here
    assert not importable("")  # find_spec raises ValueError
    # an engine class of one's own in a package that is not installed: False, not a traceback
    assert not engine_available("reroll_no_such_package.engines:MyEngine")
