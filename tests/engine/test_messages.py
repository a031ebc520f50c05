"""The one typed message set (`engine.messages`): every kind round-trips through its wire form,
and a frame that does not decode fails that frame alone, with a named error.

Generators, not examples: hypothesis draws messages of every kind (requests with every sampling
field shape the wire carries, deltas with logprobs and errors, snapshots, calls) and malformed
frames (arbitrary msgpack values, and valid frames with one field replaced by junk)."""
from __future__ import annotations

import msgpack
from hypothesis import given, settings, strategies as st

from loraserve.catalog.records import RevisionRecord
from loraserve.engine.core.engine_core import EngineCore
from loraserve.catalog.base import QuantizedFingerprint
from loraserve.engine.messages import (CALLS, Abort, Add, Batch, CoreInfo, Hello, Kind, Malformed,
                                       MalformedMessage, Ready, Residency, Return, Step, Stop,
                                       Train, Unload, Warm, decode, decode_batch, encode, to_wire)
from loraserve.engine.snapshot import EngineSnapshot
from loraserve.engine.types import (EngineError, GenerateRequest, GrammarSpec, RequestOutput,
                                    SamplingParams, TokenLogprob)
from loraserve.engine.wire import unpack

ids = st.text(min_size=1, max_size=12)
token_ids = st.lists(st.integers(0, 50_000), max_size=8)
finite = st.floats(-1e6, 1e6, allow_nan=False)

params = st.builds(
    SamplingParams, max_tokens=st.integers(1, 4096), temperature=st.floats(0, 2),
    top_p=st.floats(0.01, 1), top_k=st.integers(0, 50), seed=st.none() | st.integers(0, 2**32),
    stop=st.lists(st.text(min_size=1, max_size=5), max_size=3), ignore_eos=st.booleans(),
    logprobs=st.none() | st.integers(0, 5),
    logit_bias=st.dictionaries(st.integers(0, 1000), st.floats(-100, 100), max_size=3),
    structured=st.none() | st.builds(GrammarSpec, st.sampled_from(["regex", "choice"]),
                                     st.text(max_size=10), st.sampled_from(["guided_regex"])))
requests = st.builds(GenerateRequest, ids, st.lists(st.integers(0, 50_000), min_size=1, max_size=8),
                     params, st.none() | st.just("acme/support@r1"), st.booleans(),
                     st.sampled_from(["", "acme", "lab"]), st.floats(0.1, 10))
records = st.builds(RevisionRecord, adapter_id=st.just("acme/support"), revision=ids,
                    size=st.integers(0, 2**40), checksum=st.text(max_size=32),
                    created=st.floats(0, 2e9), base_fingerprint=st.text(max_size=32),
                    rank=st.integers(1, 256), targets=st.lists(st.sampled_from(["q_proj", "v_proj"])),
                    dtype=st.sampled_from(["float32", "bfloat16"]), source=st.text(max_size=8))
logprob = st.builds(TokenLogprob, st.integers(0, 50_000), finite,
                    st.dictionaries(st.integers(0, 50_000), finite, max_size=3))
outputs = st.builds(
    RequestOutput, ids, token_ids, st.text(max_size=8), st.none() | st.lists(logprob, max_size=3),
    st.none() | st.lists(st.none() | logprob, max_size=3),
    st.sampled_from([None, "stop", "length"]), st.integers(0, 99), st.integers(0, 99),
    st.none() | ids, st.none(), st.sampled_from([None, "device", "cpu", "catalog"]))
snapshots = st.builds(
    EngineSnapshot, running=st.integers(0, 64), waiting=st.integers(0, 64),
    kv_usage=st.floats(0, 1), running_adapters=st.lists(ids, max_size=3).map(tuple),
    resident=st.frozensets(st.tuples(ids, ids), max_size=3),
    quarantined=st.lists(st.tuples(ids, ids, st.text(max_size=8)), max_size=2).map(tuple),
    compile=st.lists(st.tuples(ids, st.just("compiled")), max_size=2).map(tuple),
    published=st.floats(0, 1e6))
call_ids = st.integers(0, 2**40)
values = st.recursive(st.none() | st.booleans() | st.integers(-2**40, 2**40) | finite
                      | st.text(max_size=8) | st.binary(max_size=8),
                      lambda inner: st.lists(inner, max_size=3)
                      | st.dictionaries(st.text(max_size=4), inner, max_size=3), max_leaves=8)
errors = st.builds(lambda m, s, c, p: EngineError(m, status=s, code=c, param=p), st.text(max_size=8),
                   st.sampled_from([400, 404, 429, 500, 503]), st.sampled_from(["bad", "gone"]),
                   st.none() | st.just("prompt"))

commands = st.one_of(
    st.just(Hello()), st.just(Stop()), st.builds(Add, requests, st.none() | records),
    st.builds(Add, requests, records, st.binary(max_size=64)),  # a blob read at the edge
    st.builds(Abort, ids), st.builds(Unload, call_ids, ids),
    st.builds(Residency, call_ids, st.lists(st.tuples(ids, ids), max_size=3).map(tuple)),
    st.builds(Warm, call_ids, records),
    st.builds(Train, call_ids, st.sampled_from(["create", "run", "drop"]),
              st.lists(values, max_size=3).map(tuple)))
quantized = st.builds(QuantizedFingerprint, ids, st.sampled_from(["gguf-Q4_1+Q8_0", "int4-g64"]), st.booleans())
answers = st.one_of(
    st.builds(Ready, st.builds(CoreInfo, st.integers(1, 2**22), ids, st.integers(1, 2**16),
                               st.integers(1, 2**18), st.none() | ids | quantized, st.integers(0, 256),
                               st.lists(st.sampled_from(["q_proj", "v_proj"])).map(tuple))),
    st.builds(Step, st.lists(outputs, max_size=4).map(tuple), st.none() | snapshots),
    st.builds(Return, call_ids, values, st.none()))
messages = st.one_of(commands, answers, st.builds(Batch, st.lists(commands, max_size=4).map(tuple)))


def _over_the_wire(msg):
    return decode(unpack(encode(msg)))


@settings(max_examples=300, deadline=None)
@given(messages)
def test_every_kind_round_trips_by_type(msg) -> None:
    back = _over_the_wire(msg)
    assert type(back) is type(msg) and back.KIND == msg.KIND
    assert back == msg


@settings(max_examples=100, deadline=None)
@given(quantized, ids)
def test_a_quantized_base_keeps_what_it_accepts(fp, other) -> None:
    """The API side checks adapters against the core's fingerprint: a GGUF repack's must still
    take the float base's adapters after the handshake (a bare str did not: 409 on every one)."""
    info = _over_the_wire(Ready(CoreInfo(1, "m", 8, 8, fp, 8, ()))).info
    back = info.base_fingerprint
    assert isinstance(back, QuantizedFingerprint) and back == fp
    assert back.accepts(fp) and back.accepts(fp.float_fingerprint) == fp.allow_float
    assert not back.accepts(other + "x")


@settings(max_examples=100, deadline=None)
@given(call_ids, values, errors)
def test_a_return_carries_its_error_by_status_code_and_param(call_id, value, err) -> None:
    back = _over_the_wire(Return(call_id, value, err))
    assert back.call_id == call_id and back.value == value
    e = back.error
    assert isinstance(e, EngineError)
    assert (str(e), e.status, e.code, e.param) == (str(err), err.status, err.code, err.param)


@settings(max_examples=100, deadline=None)
@given(outputs, errors)
def test_a_failed_delta_keeps_its_error(out, err) -> None:
    out.error = err
    [back] = _over_the_wire(Step((out,), None)).outputs
    assert (back.error.status, back.error.code, back.error.param) == (err.status, err.code, err.param)


def test_every_kind_has_a_record_and_the_calls_are_four() -> None:
    kinds = {type(m).KIND for m in (Hello(), Stop(), Abort("a"), Batch(()), Step((), None),
                                    Return(0, None))} | {c.KIND for c in CALLS} | {Add.KIND, Ready.KIND}
    assert kinds == set(Kind)
    assert {c.__name__ for c in CALLS} == {"Unload", "Residency", "Warm", "Train"}


frames = st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=6)
                      | st.floats(allow_nan=False), lambda inner: st.lists(inner, max_size=4)
                      | st.dictionaries(st.text(max_size=4), inner, max_size=3), max_leaves=10)


@settings(max_examples=500, deadline=None)
@given(frames)
def test_any_frame_decodes_or_fails_with_the_named_error(frame) -> None:
    try:
        decode(frame)
    except MalformedMessage as exc:
        assert exc.code == "malformed_message" and "malformed" in str(exc)


@settings(max_examples=300, deadline=None)
@given(commands | answers, st.data())
def test_a_frame_with_one_field_broken_fails_alone_naming_what_it_can(msg, data) -> None:
    frame = to_wire(msg)
    if len(frame) < 2:
        return  # no field to break
    i = data.draw(st.integers(1, len(frame) - 1))
    junk = data.draw(frames.filter(lambda j: j != frame[i]))
    broken = frame[:i] + [junk] + frame[i + 1:]
    good = to_wire(Abort("still-here"))
    decoded = decode_batch([int(Kind.BATCH), [broken, good]])
    assert decoded[-1] == Abort("still-here")  # the frame after it is unaffected
    if isinstance(decoded[0], Malformed):
        err = decoded[0].error
        assert err.kind == frame[0]
        if isinstance(msg, Add) and i >= 2:  # the record or blob broke: the request is still named
            assert err.request_id == msg.request.request_id
        if isinstance(msg, CALLS) and i > 1:  # a field after the call id broke: the call is named
            assert err.call_id == msg.call_id


def test_the_core_fails_a_malformed_frame_alone_and_goes_on() -> None:
    """A malformed add fails its request; a malformed call returns its error; a frame that
    names nothing is logged and dropped; the core answers the next message."""

    class Engine:  # what EngineCore reads of an LLMEngine here
        adapters, scheduler = None, None

        def set_notify(self, wake) -> None:
            pass

        def publish(self, force: bool = True) -> None:  # the snapshot EngineCore publishes at start
            pass

    core = EngineCore(Engine())
    bad_add = [int(Kind.ADD), {"id": "r1", "prompt": "not a list"}, None]
    bad_call = [int(Kind.UNLOAD), 7, 42]
    nameless = [int(Kind.ABORT)]
    [m1, m2, m3] = [m for f in (bad_add, bad_call, nameless) for m in decode_batch(f)]
    assert all(isinstance(m, Malformed) for m in (m1, m2, m3))
    [failed] = core.handle(m1)
    assert failed.request_id == "r1" and failed.finish_reason == "error"
    assert failed.error.code == "malformed_message"
    assert core.handle(m2) == [] and core.handle(m3) == []
    [ret] = core.replies()
    assert ret.call_id == 7 and isinstance(ret.error, MalformedMessage)
    assert core.handle(Residency(8, (("a", "b"),))) == []
    assert core.replies() == [Return(8, ["disk"])]  # and the core goes on


def test_bytes_that_are_not_msgpack_never_reach_decode_as_a_message() -> None:
    """A stream's bytes are split by msgpack; garbage raises there (the process transport ends
    that stream), never inside a message handler."""
    unpacker = msgpack.Unpacker(raw=False)
    unpacker.feed(b"\xc1")  # a byte msgpack never uses
    try:
        list(unpacker)
    except ValueError:
        pass
    else:
        raise AssertionError("msgpack took 0xc1")
