"""The tier table (`tests/tiers.py`): which tests a rule marks, and that a stale rule or a marker
name pyproject.toml does not register stops the run."""

from __future__ import annotations

import sys

import pytest
from tiers import RULES, SHARDED, SLOW, SUBPROCESS, Rule, mark, marks_for, registered, stale


def test_a_rule_with_a_selection_marks_the_named_tests_and_those_requesting_its_fixtures():
    rule = Rule("test_a.py", SLOW, only=("test_x",), uses=("eng",))
    assert rule.applies_to("test_a.py", "test_x", [])
    assert rule.applies_to("test_a.py", "test_y", ["tiny", "eng"])
    assert not rule.applies_to("test_a.py", "test_y", ["tiny"])
    assert not rule.applies_to("test_b.py", "test_x", ["eng"])


def test_a_rule_without_a_selection_marks_its_module_but_the_exceptions():
    rule = Rule("test_a.py", SLOW, but=("test_x",))
    assert rule.applies_to("test_a.py", "test_y", [])
    assert not rule.applies_to("test_a.py", "test_x", [])


def test_markers_of_several_rules_merge_once_each_in_rule_order():
    rules = [Rule("test_a.py", SLOW + SUBPROCESS), Rule("test_a.py", SLOW + SHARDED), Rule("test_b.py", SHARDED)]
    assert marks_for(rules, "test_a.py", "test_x", []) == ["slow", "subprocess", "sharded"]


def test_a_stale_rule_names_the_missing_module_test_or_fixture():
    this = sys.modules[__name__]
    rules = [Rule("test_gone.py", SLOW), Rule("test_tiers.py", SLOW, only=("test_renamed",), uses=("no_fixture",))]
    assert stale(rules, {"test_tiers.py": this}) == [
        "tests/tiers.py: test_gone.py is not a file in tests/",
        "tests/tiers.py: test_tiers.py defines no test_renamed",
        "tests/tiers.py: test_tiers.py defines no no_fixture",
    ]
    assert stale(RULES, {"test_tiers.py": this}) == []


def test_an_unregistered_marker_stops_the_run_and_the_table_uses_only_registered_ones(pytestconfig):
    assert pytestconfig.getoption("strict_markers")
    assert {m for rule in RULES for m in rule.marks} == {"slow", "subprocess", "sharded"} <= registered(pytestconfig)
    with pytest.raises(pytest.UsageError, match="marker 'slwo' is not registered"):
        mark(pytestconfig, [], [Rule("test_tiers.py", ("slwo",))])
