"""Adapter ids, model references and record round-trips."""
import pytest

from loraserve.catalog.errors import InvalidAdapterId
from loraserve.catalog.ids import parse_model_ref, validate_adapter_id
from loraserve.catalog.records import PolicyRecord, RevisionRecord


@pytest.mark.parametrize("good", ["acme/support", "a/b", "t-1/n_2.v3", "x" * 64 + "/" + "y" * 128])
def test_valid_ids(good):
    assert validate_adapter_id(good) == good


@pytest.mark.parametrize("bad", [
    "", "acme", "acme/", "/x", "a/b/c", "../etc", "a/..", "a/.", "a b/c", "a/c\0", "ä/b", "a/b?x",
    "x" * 65 + "/b", "a/" + "y" * 129, "/etc/passwd", "a\\b/c",
])
def test_invalid_ids_rejected(bad):
    with pytest.raises(InvalidAdapterId) as e:
        validate_adapter_id(bad)
    assert e.value.status == 400


def test_parse_model_ref():
    assert parse_model_ref("acme/support") == ("acme/support", None)
    assert parse_model_ref("acme/support@r3") == ("acme/support", "r3")
    assert parse_model_ref("acme/support@stable") == ("acme/support", "stable")
    for bad in ("acme/support@", "acme/support@r1@r2", "acme@r1", "acme/x@../y", 17):
        with pytest.raises(InvalidAdapterId):
            parse_model_ref(bad)


def test_records_round_trip():
    rev = RevisionRecord("a/b", "r1", 10, "c" * 32, 1.5, "f" * 32, 4, ["q_proj"], "bfloat16", "peft:x")
    assert RevisionRecord.from_json(rev.to_json()) == rev
    assert rev.ref == "a/b@r1"
    pol = PolicyRecord("a/b", "f" * 32, 4, ["q_proj"], ["r1", "r2"], "r2", "r1", {"stable": "r1"}, 1.0, 2.0)
    assert PolicyRecord.from_json(pol.to_json()) == pol


def test_policy_rejects_dangling_revision():
    with pytest.raises(ValueError):
        PolicyRecord("a/b", "f", 1, ["q_proj"], ["r1"], promoted="r9")
